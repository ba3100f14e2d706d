"""The prepared dataset on disk (any fsspec URL): shards, rejects, plan, manifest.

Layout under `data.output`:
  plan.json                  config/tokenizer hashes and the chunk list; a re-run must match it
  tokenizer/                 the exact tokenizer and template used
  data/part-NNNNNN.parquet   prepared rows of chunk NNNNNN
  rejects/part-NNNNNN.jsonl  rejected rows of that chunk, with reasons and the raw row
  stats/part-NNNNNN.json     the chunk's counts and checksums; written last, it marks the shard complete
  manifest.json              totals, token histogram and the shard list, once every shard is complete

Every file is written under a temporary name and renamed, so a killed run
leaves complete shards or none, and a re-run skips the complete ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from raypipe import __version__
from raypipe.data.prepare import HISTOGRAM_EDGES, ShardResult
from raypipe.data.sources import Chunk
from raypipe.storage import Storage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

COUNT_KEYS = ("rows_in", "blank_lines", "split_extra", "rows_kept", "rows_rejected", "needs_response", "truncated", "tokens_tokenized", "tokens", "loss_tokens")


def shard_name(index: int) -> str:
    return f"part-{index:06d}"


class PreparedOutput(Storage):
    def read_manifest(self) -> dict[str, Any]:
        """The finished dataset's manifest; a clear error when the data stage has not completed."""
        if not self.exists("manifest.json"):
            raise ValueError(f"{self.url} has no manifest.json: the data stage has not completed there; run `raypipe prepare` with this data.output first")
        return self.read_json("manifest.json")

    def start(self, plan: list[Chunk], config_hash: str, tokenizer_hash: str, tok: PreTrainedTokenizerBase) -> None:
        """Record the plan, or check that an existing output was made by the same one."""
        doc = {"config_hash": config_hash, "tokenizer_hash": tokenizer_hash, "chunks": [c.to_dict() for c in plan]}
        if self.exists("plan.json"):
            old = self.read_json("plan.json")
            if old != doc:
                what = "config" if old["config_hash"] != config_hash else "tokenizer/template" if old["tokenizer_hash"] != tokenizer_hash else "input files"
                raise ValueError(
                    f"data.output {self.url} holds a run with a different {what}; "
                    "set a new data.output or delete the old one to start over"
                )
            for leftover in self.fs.glob(self.path("**", "*.tmp-*")):  # from a killed run; one run per output at a time
                self.fs.rm(leftover)
            return
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            for file in sorted(Path(tmp).iterdir()):
                self.write(f"tokenizer/{file.name}", file.read_bytes())
        self.write("plan.json", _dumps(doc))

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
        stats = {**result.stats, "file": f"data/{name}.parquet", "sha256": _sha256(shard), "rejects_sha256": _sha256(rejects)}
        self.write(f"stats/{name}.json", _dumps(stats))
        return stats

    def write_manifest(self, plan: list[Chunk], config_hash: str, tokenizer_hash: str, template_hash: str, end_of_turn: dict[str, Any]) -> dict[str, Any]:
        shards = [self.read_json(f"stats/{shard_name(c.index)}.json") for c in plan]
        totals = {k: sum(s[k] for s in shards) for k in COUNT_KEYS}
        assert totals["rows_in"] + totals["split_extra"] == totals["rows_kept"] + totals["rows_rejected"], "row accounting broke"
        rejects: dict[str, int] = {}
        for s in shards:
            for code, n in s["rejects_by_code"].items():
                rejects[code] = rejects.get(code, 0) + n
        manifest = {
            "raypipe_version": __version__,
            "config_hash": config_hash,
            "tokenizer_hash": tokenizer_hash,
            "template_hash": template_hash,
            "end_of_turn": end_of_turn,  # where on-policy replies stop
            "counts": totals,
            "rejects_by_code": dict(sorted(rejects.items())),
            "token_histogram": {
                "upper_edges": [*HISTOGRAM_EDGES, None],
                "rows": [sum(s["histogram"][i] for s in shards) for i in range(len(HISTOGRAM_EDGES) + 1)],
            },
            "shards": [
                {"file": s["file"], "rows": s["rows_kept"], "sha256": s["sha256"], "rejects": f"rejects/{shard_name(s['shard'])}.jsonl", "rejected": s["rows_rejected"]}
                for s in shards
            ],
        }
        self.write("manifest.json", _dumps(manifest))
        return manifest


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
