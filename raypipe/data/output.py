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
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from raypipe import __version__
from raypipe.data.prepare import HISTOGRAM_EDGES, ShardResult
from raypipe.data.sources import Chunk, filesystem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

COUNT_KEYS = ("rows_in", "blank_lines", "split_extra", "rows_kept", "rows_rejected", "needs_response", "truncated", "tokens_tokenized", "tokens", "loss_tokens")


def shard_name(index: int) -> str:
    return f"part-{index:06d}"


class PreparedOutput:
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def _write(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _read_json(self, rel: str) -> Any:
        with self.fs.open(self._path(rel), "rb") as f:
            return json.load(f)

    def start(self, plan: list[Chunk], config_hash: str, tokenizer_hash: str, tok: PreTrainedTokenizerBase) -> None:
        """Record the plan, or check that an existing output was made by the same one."""
        doc = {"config_hash": config_hash, "tokenizer_hash": tokenizer_hash, "chunks": [c.to_dict() for c in plan]}
        if self.fs.exists(self._path("plan.json")):
            old = self._read_json("plan.json")
            if old != doc:
                what = "config" if old["config_hash"] != config_hash else "tokenizer/template" if old["tokenizer_hash"] != tokenizer_hash else "input files"
                raise ValueError(
                    f"data.output {self.url} holds a run with a different {what}; "
                    "set a new data.output or delete the old one to start over"
                )
            for leftover in self.fs.glob(self._path("**", "*.tmp-*")):  # from a killed run; one run per output at a time
                self.fs.rm(leftover)
            return
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            for file in sorted(Path(tmp).iterdir()):
                self._write(f"tokenizer/{file.name}", file.read_bytes())
        self._write("plan.json", _dumps(doc))

    def is_done(self, index: int) -> bool:
        return self.fs.exists(self._path(f"stats/{shard_name(index)}.json"))

    def write_shard(self, result: ShardResult) -> dict[str, Any]:
        name = shard_name(result.stats["shard"])
        buf = io.BytesIO()
        pq.write_table(result.table, buf, compression="zstd")
        shard = buf.getvalue()
        rejects = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rejects).encode()
        self._write(f"data/{name}.parquet", shard)
        self._write(f"rejects/{name}.jsonl", rejects)
        stats = {**result.stats, "file": f"data/{name}.parquet", "sha256": _sha256(shard), "rejects_sha256": _sha256(rejects)}
        self._write(f"stats/{name}.json", _dumps(stats))
        return stats

    def write_manifest(self, plan: list[Chunk], config_hash: str, tokenizer_hash: str, template_hash: str) -> dict[str, Any]:
        shards = [self._read_json(f"stats/{shard_name(c.index)}.json") for c in plan]
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
        self._write("manifest.json", _dumps(manifest))
        return manifest


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
