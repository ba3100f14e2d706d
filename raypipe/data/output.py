"""The prepared dataset on disk (any fsspec URL): shards, rejects, plan, manifest.

Layout under `data.output`:
  plan.json                  what the rows depend on (see `dependencies`) and the chunk list; a re-run must match it
  tokenizer/                 the exact tokenizer and template used
  data/part-NNNNNN.parquet   prepared rows of chunk NNNNNN
  rejects/part-NNNNNN.jsonl  rejected rows of that chunk, with reasons and the raw row
  stats/part-NNNNNN.json     the chunk's counts and checksums; written last, it marks the shard complete
  manifest.json              totals, token histogram and the shard list, once every shard is complete

Every file is written under a temporary name and renamed, so a killed run
leaves complete shards or none, and a re-run skips the complete ones.

A re-run whose rows would depend on anything else (the data config, the
tokenizer, the template's text, an input file's size and ETag or mtime, the
raypipe version) is refused with a message, never re-planned over the old
shards: the fix is a new `data.output`, or deleting the old one. An input in
the working-dir package of a submitted job is named by its place in the
package (`working_dir:data/x.jsonl`, in plan.json, the rejects and the sample
ids) and known by its size and sha256: Ray's next copy of the package has
another folder name and new mtimes, and a resubmitted job resumes.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

import raypipe
from raypipe import __version__
from raypipe.data.prepare import HISTOGRAM_EDGES, ShardResult
from raypipe.data.sources import Chunk, list_files
from raypipe.storage import Storage, absolute, filesystem, input_identity

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from raypipe.config import DataConfig
    from raypipe.data.tokenizer import TokenizerSpec

COUNT_KEYS = (
    "rows_in",
    "blank_lines",
    "split_extra",
    "rows_kept",
    "rows_rejected",
    "needs_response",
    "truncated",
    "tokens_tokenized",
    "tokens",
    "loss_tokens",
)


# What a differing plan.json key means, for the refusal message.
_PLAN_KEYS = {
    "raypipe_version": "raypipe version",
    "config_hash": "config",
    "tokenizer_hash": "tokenizer or chat template",
    "template_hash": "tokenizer or chat template",
    "inputs": "input files",
    "chunks": "input files",
}


def shard_name(index: int) -> str:
    return f"part-{index:06d}"


def dependencies(cfg: DataConfig, spec: TokenizerSpec) -> dict[str, Any]:
    """What the prepared rows depend on: raypipe's version, the data config, the tokenizer and the template's text
    (not its name: a template edited in place counts), and each input file's size plus ETag or mtime (plus sha256 in a
    job's working-dir package: raypipe.storage.input_identity)."""
    for source in cfg.sources:
        fs, _ = filesystem(source.path, cfg.storage_options)
        fs.invalidate_cache()  # files added or changed since a listing in this process
    files = [url for source in cfg.sources for url in list_files(source, cfg.storage_options)]
    return {
        "raypipe_version": raypipe.__version__,
        "config_hash": cfg.output_hash(),
        "tokenizer_hash": spec.digest(),
        "template_hash": spec.template_digest(),
        "inputs": {url: input_identity(url, cfg.storage_options) for url in files},
    }


class PreparedOutput(Storage):
    @classmethod
    def of(cls, cfg: DataConfig) -> PreparedOutput:
        """`data.output`, a local path made absolute: trainers and reply engines read it from other processes."""
        return cls(absolute(cfg.output), cfg.storage_options)

    def manifest_bytes(self) -> bytes:
        """manifest.json as written (its sha256 is what training chains on); a clear error when the data stage has not
        completed."""
        self.refresh()  # written by another process since this one listed here
        if not self.exists("manifest.json"):
            raise ValueError(
                f"{self.url} has no manifest.json: the data stage has not completed there; run `raypipe prepare` with "
                "this data.output first"
            )
        return self.read("manifest.json")

    def manifest_sha256(self) -> str:
        """The digest of manifest.json (it covers every shard's checksum): what training and checkpoints chain on."""
        return _sha256(self.manifest_bytes())

    def start(self, doc: dict[str, Any], tok: PreTrainedTokenizerBase) -> None:
        """Record the plan (`dependencies` plus the chunks), or check that an existing output was made by the same
        one."""
        self.refresh()  # a killed run's files were written by other processes
        if self.exists("plan.json"):
            old = self.read_json("plan.json")
            if old != doc:
                what = dict.fromkeys(
                    _PLAN_KEYS.get(k, k) for k in sorted(old.keys() | doc.keys()) if old.get(k) != doc.get(k)
                )
                raise ValueError(
                    f"data.output {self.url} holds a run made with a different {', '.join(what)} (see its plan.json): "
                    f"its shards must not mix with new ones; set a new data.output, or delete {self.url} to start over"
                )
            for leftover in self.fs.glob(self.path("**", "*.tmp-*")):  # from a killed run; one run per output at a time
                self.fs.rm(leftover)
            return
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            for file in sorted(Path(tmp).iterdir()):
                self.write(f"tokenizer/{file.name}", file.read_bytes())
        self.write("plan.json", _dumps(doc))

    def planned_chunks(self, deps: dict[str, Any]) -> list[Chunk] | None:
        """The chunks of an earlier run with the same dependencies (it is resumed with its own shards, however the
        actor count changed since), None when there is none (`start` refuses an output of other dependencies)."""
        self.refresh()
        if not self.exists("plan.json"):
            return None
        old = self.read_json("plan.json")
        if {k: v for k, v in old.items() if k != "chunks"} != deps:
            return None
        if any("files" not in c for c in old["chunks"]):  # planned before a chunk could hold several files
            raise ValueError(
                f"data.output {self.url} was planned by an earlier raypipe, one file range per shard: its shards must "
                f"not mix with new ones; set a new data.output, or delete {self.url} to start over"
            )
        return [Chunk.from_dict(c) for c in old["chunks"]]

    def is_done(self, index: int) -> bool:
        return self.exists(f"stats/{shard_name(index)}.json")

    def write_shard(self, result: ShardResult) -> dict[str, Any]:
        name = shard_name(result.stats["shard"])
        buf = io.BytesIO()
        pq.write_table(result.table, buf, compression="zstd")
        shard = buf.getvalue()
        rejects = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rejects).encode()
        self.write(f"data/{name}.parquet", shard)
        self.write(f"rejects/{name}.jsonl", rejects)
        stats = {
            **result.stats,
            "file": f"data/{name}.parquet",
            "sha256": _sha256(shard),
            "rejects_sha256": _sha256(rejects),
        }
        self.write(f"stats/{name}.json", _dumps(stats))
        return stats

    def write_manifest(
        self, plan: list[Chunk], deps: dict[str, Any], end_of_turn: dict[str, Any], unmatched: list[str]
    ) -> dict[str, Any]:
        """Totals over every shard (`deps`: what `dependencies` returned for the plan); files that could not be read and
        files not matched are named, not only counted."""
        shards = [self.read_json(f"stats/{shard_name(c.index)}.json") for c in plan]
        totals = {k: sum(s[k] for s in shards) for k in COUNT_KEYS}
        assert totals["rows_in"] + totals["split_extra"] == totals["rows_kept"] + totals["rows_rejected"], (
            "row accounting broke"
        )
        unreadable = {f["file"]: f["reason"] for s in shards for f in s["files_rejected"]}
        totals["files_rejected"], totals["files_unmatched"] = len(unreadable), len(unmatched)
        rejects: dict[str, int] = {}
        for s in shards:
            for code, n in s["rejects_by_code"].items():
                rejects[code] = rejects.get(code, 0) + n
        manifest = {
            "raypipe_version": __version__,
            **{k: deps[k] for k in ("config_hash", "tokenizer_hash", "template_hash")},
            "end_of_turn": end_of_turn,  # where on-policy replies stop
            "counts": totals,
            "rejects_by_code": dict(sorted(rejects.items())),
            "files_rejected": [
                {"file": f, "reason": r} for f, r in sorted(unreadable.items())
            ],  # unreadable; see rejects/ for the rows read before
            "files_unmatched": unmatched,  # present under a source's path but not read: another suffix
            "token_histogram": {
                "upper_edges": [*HISTOGRAM_EDGES, None],
                "rows": [sum(s["histogram"][i] for s in shards) for i in range(len(HISTOGRAM_EDGES) + 1)],
            },
            "shards": [
                {
                    "file": s["file"],
                    "rows": s["rows_kept"],
                    "sha256": s["sha256"],
                    "rejects": f"rejects/{shard_name(s['shard'])}.jsonl",
                    "rejected": s["rows_rejected"],
                }
                for s in shards
            ],
        }
        self.write("manifest.json", _dumps(manifest))
        return manifest


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
