"""The prepared dataset as training rows, with on-policy replies in place of placeholders.

Metadata (ids, lengths, flags) of every row is read once; token columns are
read a shard at a time and a few shards are kept, which suits the windowed
epoch order of raypipe.train.plan.

A `needs_response` row was prepared as prompt + placeholder reply. Before it
is trained on, the target's own reply replaces the placeholder: replies are
generated once by the reply pass (raypipe.train.replies), stored as token ids
under `replies/` of the run directory (one Parquet file per prepared shard,
written atomically, each reply keyed by its row's position in the shard, so
rows that share a sample_id keep their own), and reused by every later epoch
and by resumed runs, which then only re-extract states.

A shard's token columns are read whole and checked against the sha256 the
manifest records for it, so a shard changed or corrupted since the data stage
is refused with its name, never trained on. (The metadata read at start-up
takes only a few columns; a shard whose metadata cannot be read is checked
there too, so that failure names the shard as well.)
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.data.output import PreparedOutput, shard_name
from raypipe.storage import Storage

REPLY_SCHEMA = pa.schema([("row", pa.int32()), ("reply_ids", pa.list_(pa.int32()))])
_META_COLUMNS = ["sample_id", "num_tokens", "needs_response", "prompt_len"]


@dataclass(frozen=True)
class Row:
    sample_id: str
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # int64 [T]


class PreparedRows:
    def __init__(self, prepared: PreparedOutput, replies: Storage, max_length: int, cache_shards: int = 8) -> None:
        self.prepared = prepared
        manifest = prepared.manifest_bytes()
        self.manifest = json.loads(manifest)
        self.manifest_sha256 = hashlib.sha256(manifest).hexdigest()
        self.end_of_turn_id: int = self.manifest["end_of_turn"]["id"]  # where on-policy replies stop
        self.replies = replies
        self.max_length = max_length
        self.shard_files = [s["file"] for s in self.manifest["shards"]]
        self.shard_sizes = [s["rows"] for s in self.manifest["shards"]]
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        metas = [self._read_meta(s) for s in range(len(self.shard_files))]
        self.sample_ids: list[str] = [sid for m in metas for sid in m.column("sample_id").to_pylist()]
        self.needs_response = (
            np.concatenate([m.column("needs_response").to_numpy(zero_copy_only=False) for m in metas])
            if metas
            else np.zeros(0, bool)
        )
        self.prompt_len = (
            np.concatenate([m.column("prompt_len").to_numpy() for m in metas]).astype(np.int64)
            if metas
            else np.zeros(0, np.int64)
        )
        self._prepared_len = (
            np.concatenate([m.column("num_tokens").to_numpy() for m in metas]).astype(np.int64)
            if metas
            else np.zeros(0, np.int64)
        )
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._replies: dict[int, dict[int, np.ndarray]] = {}  # shard -> row position in the shard -> reply
        self._cache_shards = cache_shards

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _read_meta(self, shard: int) -> pa.Table:
        try:
            with self.prepared.fs.open(self.prepared.path(self.shard_files[shard]), "rb") as f:
                return pq.read_table(f, columns=_META_COLUMNS)
        except (OSError, pa.ArrowException):
            self._verified(shard)  # a changed or corrupted file: the checksum error names it and the fix
            raise

    def _verified(self, shard: int) -> bytes:
        """The shard file's bytes, checked against the manifest's sha256."""
        entry = self.manifest["shards"][shard]
        data = self.prepared.read(entry["file"])
        found = hashlib.sha256(data).hexdigest()
        if found != entry["sha256"]:
            raise ValueError(
                f"prepared shard {self.prepared.url}/{entry['file']} does not match manifest.json (sha256 "
                f"{found[:16]}..., recorded {entry['sha256'][:16]}...): it changed or was corrupted after the data "
                f"stage. Delete stats/{shard_name(shard)}.json and manifest.json there and re-run `raypipe prepare` "
                "with the same config: it rewrites that shard"
            )
        return data

    def shard_of(self, index: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return shard, int(index - self.offsets[shard])

    def check_replies_meta(self, meta: dict[str, Any], write: bool) -> None:
        """Stored replies belong to one target, dataset and sampling; anything else is refused, not mixed in."""
        if self.replies.exists("meta.json"):
            found = self.replies.read_json("meta.json")
            if found != meta:
                raise ValueError(
                    f"{self.replies.url} holds replies made with {found}, not {meta}; use a new train.output or delete "
                    "its replies/"
                )
        elif write:
            self.replies.write_json("meta.json", meta)

    def shards_needing_replies(self) -> list[int]:
        """Shards with needs_response rows whose replies are not stored yet."""
        return [
            s
            for s in range(len(self.shard_files))
            if self.needs_response[self.offsets[s] : self.offsets[s + 1]].any()
            and not self.replies.exists(f"{shard_name(s)}.parquet")
        ]

    def prompts_of(self, shard: int) -> tuple[list[int], list[list[int]]]:
        """(row positions in the shard, prompt ids) of a shard's needs_response rows."""
        table = self._shard(shard)
        rows = np.flatnonzero(self.needs_response[self.offsets[shard] : self.offsets[shard + 1]])
        ids = table.column("input_ids")
        return [int(r) for r in rows], [ids[int(r)].as_py()[: self.prompt_len[self.offsets[shard] + r]] for r in rows]

    def write_replies(self, shard: int, positions: list[int], replies: list[list[int]]) -> None:
        buf = io.BytesIO()
        pq.write_table(pa.table({"row": positions, "reply_ids": replies}, schema=REPLY_SCHEMA), buf)
        self.replies.write(f"{shard_name(shard)}.parquet", buf.getvalue())

    def load_replies(self) -> None:
        """Read every stored reply; each needs_response row must have one (else the reply pass did not finish)."""
        for shard in range(len(self.shard_files)):
            lo, hi = self.offsets[shard], self.offsets[shard + 1]
            if not self.needs_response[lo:hi].any():
                continue
            table = pq.read_table(io.BytesIO(self.replies.read(f"{shard_name(shard)}.parquet")))
            self._replies[shard] = {
                int(r): np.asarray(ids, np.int64)
                for r, ids in zip(table.column("row").to_pylist(), table.column("reply_ids").to_pylist(), strict=True)
            }
            missing = [
                self.sample_ids[i]
                for i in range(lo, hi)
                if self.needs_response[i] and int(i - lo) not in self._replies[shard]
            ]
            assert not missing, f"replies of shard {shard} lack {len(missing)} rows, e.g. {missing[0]}"

    def lengths(self) -> np.ndarray:
        """Tokens per row as trained: prompt + stored reply (cut to max_length) for needs_response rows."""
        lengths = self._prepared_len.copy()
        for shard, replies in self._replies.items():
            for position, reply in replies.items():
                i = self.offsets[shard] + position
                lengths[i] = min(self.prompt_len[i] + len(reply), self.max_length)
        return lengths

    def _shard(self, shard: int) -> pa.Table:
        if shard in self._tables:
            self._tables.move_to_end(shard)
        else:
            self._tables[shard] = pq.read_table(io.BytesIO(self._verified(shard)), columns=["input_ids", "loss_mask"])
            if len(self._tables) > self._cache_shards:
                self._tables.popitem(last=False)
        return self._tables[shard]

    def row(self, index: int) -> Row:
        shard, local = self.shard_of(index)
        table = self._shard(shard)
        ids = np.asarray(table.column("input_ids")[local].as_py(), np.int64)
        mask = np.asarray(table.column("loss_mask")[local].as_py(), np.int64)
        if self.needs_response[index]:
            reply = self._replies[shard][local]
            prompt = ids[: self.prompt_len[index]]
            ids = np.concatenate([prompt, reply])[: self.max_length]
            mask = np.concatenate([np.zeros(len(prompt), np.int64), np.ones(len(reply), np.int64)])[: self.max_length]
        return Row(self.sample_ids[index], ids, mask)
