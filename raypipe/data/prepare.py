"""One chunk of raw rows -> prepared token rows, rejects and counts (no Ray here).

Rows are parsed, normalized, given a placeholder reply where they have none,
rendered and cut at mask boundaries one by one (cheap), then tokenized
`batch_rows` at a time with one batched tokenizer call (the expensive part),
and assembled with numpy so the stage runs near the tokenizer's own speed.

Accounting: every non-blank input row becomes one candidate row, or several
when a history-rewriting template forces per-turn rows (`split_extra`);
`rows_in + split_extra == rows_kept + rows_rejected` always holds, and every
rejected candidate has a reject record.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from raypipe.config import DataConfig
from raypipe.data.formats import Reject, normalize
from raypipe.data.render import ChatRenderer, Segmented
from raypipe.data.sources import Chunk, read_chunk
from raypipe.data.tokenizer import TokenizerSpec

PREPARED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("needs_response", pa.bool_()),
        ("prompt_len", pa.int32()),
    ]
)
# Upper bucket edges of the token-length histogram in the manifest.
HISTOGRAM_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class ShardResult:
    table: pa.Table
    rejects: list[dict[str, Any]]
    stats: dict[str, Any]


@dataclass
class _Pending:
    sample_id: str
    position: int
    raw: bytes | dict[str, Any]
    rows: list[Segmented]


@dataclass
class _Counts:
    rows_in: int = 0
    blank_lines: int = 0
    split_extra: int = 0
    rows_kept: int = 0
    needs_response: int = 0
    tokens_tokenized: int = 0  # before the length policy: the tokenizer's work, for throughput
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    rejects: Counter = field(default_factory=Counter)
    histogram: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_EDGES) + 1))


def fit_length(mask: np.ndarray, prompt_len: int, needs_response: bool, max_length: int, policy: str) -> tuple[int, int]:
    """(kept tokens, prompt_len) under the max-length policy; raises Reject.

    Truncation keeps the head: the supervised tail is cut. A row left with no
    supervised token is useless (rejected); a placeholder row needs its whole
    prompt plus room for the reply the target will write.
    """
    n = len(mask)
    if n <= max_length:
        return n, prompt_len
    if policy == "reject":
        raise Reject("length", "too_long", f"{n} tokens > data.max_length {max_length} (data.overlength=reject)")
    if needs_response:
        if prompt_len >= max_length:
            raise Reject("length", "prompt_too_long", f"prompt has {prompt_len} tokens, data.max_length {max_length} leaves no room for the reply")
        return max_length, prompt_len
    kept = mask[:max_length]
    ones = np.flatnonzero(kept)
    if len(ones) == 0:
        raise Reject("length", "no_loss_in_window", f"no supervised token within the first {max_length} of {n} tokens")
    if prompt_len >= max_length:  # the last turn was cut: its prompt ends where the last kept supervised run starts
        starts = np.flatnonzero(np.diff(kept.astype(np.int8), prepend=0) == 1)
        prompt_len = int(starts[-1])
    return max_length, prompt_len


def fallback_id(url: str, position: int) -> str:
    """Stable id for rows without one: the file and the row's position in it."""
    return hashlib.sha1(f"{url}:{position}".encode()).hexdigest()[:20]


class ShardPreparer:
    """Holds one tokenizer and template; prepares chunks one after another."""

    def __init__(self, cfg: DataConfig, spec: TokenizerSpec) -> None:
        self.cfg = cfg
        self.backend = Tokenizer.from_str(spec.tokenizer_json)
        self.renderer = ChatRenderer(spec.chat_template, spec.template_kwargs, spec.end_of_turn, cfg.placeholder_reply, list(spec.reserved))

    def prepare(self, chunk: Chunk) -> ShardResult:
        counts = _Counts()
        rejects: list[dict[str, Any]] = []
        batches: list[pa.RecordBatch] = []
        pending: list[_Pending] = []
        for position, raw in read_chunk(chunk, self.cfg.storage_options):
            if isinstance(raw, bytes) and not raw.strip():
                counts.blank_lines += 1
                continue
            counts.rows_in += 1
            sample_id = fallback_id(chunk.url, position)
            try:
                record = self._parse(raw)
                conv = normalize(record, chunk.format)
                sample_id = conv.id or sample_id
                rows = self.renderer.segment(conv)
            except Reject as rej:
                rejects.append(_reject_record(chunk, sample_id, position, raw, rej))
                counts.rejects[rej.code] += 1
                continue
            counts.split_extra += len(rows) - 1
            pending.append(_Pending(sample_id, position, raw, rows))
            if len(pending) >= self.cfg.batch_rows:
                batches.append(self._tokenize(chunk, pending, counts, rejects))
                pending = []
        if pending:
            batches.append(self._tokenize(chunk, pending, counts, rejects))
        table = pa.Table.from_batches(batches, schema=PREPARED_SCHEMA)
        return ShardResult(table, rejects, _stats(chunk, counts, len(rejects)))

    def _parse(self, raw: bytes | dict[str, Any]) -> Any:
        if isinstance(raw, dict):
            return raw
        if len(raw) > self.cfg.max_row_bytes:
            raise Reject("read", "oversized_row", f"row has {len(raw)} bytes > data.max_row_bytes {self.cfg.max_row_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise Reject("parse", "invalid_utf8", f"invalid UTF-8 at byte {err.start}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise Reject("parse", "invalid_json", f"malformed JSON: {err.msg} at column {err.colno}") from None

    def _tokenize(self, chunk: Chunk, pending: list[_Pending], counts: _Counts, rejects: list[dict[str, Any]]) -> pa.RecordBatch:
        """One batched tokenizer call for every piece of every row, then numpy assembly."""
        rows = [(p, seg) for p in pending for seg in p.rows]
        texts = [text for _, seg in rows for text, _ in seg.pieces]
        id_lists = [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        flat = np.fromiter(chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths.sum()))
        supervised = np.fromiter((sup for _, seg in rows for _, sup in seg.pieces), dtype=np.int8, count=len(texts))
        mask = np.repeat(supervised, lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        counts.tokens_tokenized += len(flat)

        ids_out, mask_out, list_offsets = [], [], [0]
        columns: dict[str, list[Any]] = {k: [] for k in ("sample_id", "source", "num_tokens", "num_loss_tokens", "needs_response", "prompt_len")}
        piece = 0
        for p, seg in rows:
            a, b = int(offsets[piece]), int(offsets[piece + len(seg.pieces)])
            prompt_len = int(offsets[piece + seg.prompt_pieces]) - a
            piece += len(seg.pieces)
            row_id = p.sample_id if seg.turn is None else f"{p.sample_id}#{seg.turn}"
            try:
                n, prompt_len = fit_length(mask[a:b], prompt_len, seg.needs_response, self.cfg.max_length, self.cfg.overlength)
            except Reject as rej:
                rejects.append(_reject_record(chunk, row_id, p.position, p.raw, rej))
                counts.rejects[rej.code] += 1
                continue
            counts.truncated += n < b - a
            row_mask = mask[a : a + n]
            n_loss = int(row_mask.sum())
            ids_out.append(flat[a : a + n])
            mask_out.append(row_mask)
            list_offsets.append(list_offsets[-1] + n)
            columns["sample_id"].append(row_id)
            columns["source"].append(chunk.source)
            columns["num_tokens"].append(n)
            columns["num_loss_tokens"].append(n_loss)
            columns["needs_response"].append(seg.needs_response)
            columns["prompt_len"].append(prompt_len)
            counts.rows_kept += 1
            counts.needs_response += seg.needs_response
            counts.tokens += n
            counts.loss_tokens += n_loss
            counts.histogram[int(np.searchsorted(HISTOGRAM_EDGES, n))] += 1
        list_offsets_arr = pa.array(list_offsets, type=pa.int32())
        empty_i32, empty_i8 = np.zeros(0, np.int32), np.zeros(0, np.int8)
        arrays = {
            **{k: pa.array(v, type=PREPARED_SCHEMA.field(k).type) for k, v in columns.items()},
            "input_ids": pa.ListArray.from_arrays(list_offsets_arr, pa.array(np.concatenate(ids_out) if ids_out else empty_i32)),
            "loss_mask": pa.ListArray.from_arrays(list_offsets_arr, pa.array(np.concatenate(mask_out) if mask_out else empty_i8)),
        }
        return pa.RecordBatch.from_arrays([arrays[f.name] for f in PREPARED_SCHEMA], schema=PREPARED_SCHEMA)


def _reject_record(chunk: Chunk, sample_id: str, position: int, raw: bytes | dict[str, Any], rej: Reject) -> dict[str, Any]:
    """Everything needed to find, understand and recover the row: no data is lost."""
    record: dict[str, Any] = {
        "sample_id": sample_id,
        "source": chunk.source,
        "file": chunk.url,
        "position": position,
        "stage": rej.stage,
        "code": rej.code,
        "reason": rej.reason,
    }
    if isinstance(raw, dict):
        record["raw"] = json.dumps(raw, ensure_ascii=False, default=str)
    else:
        try:
            record["raw"] = raw.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError:
            record["raw_base64"] = base64.b64encode(raw).decode()
    return record


def _stats(chunk: Chunk, counts: _Counts, n_rejected: int) -> dict[str, Any]:
    assert counts.rows_in + counts.split_extra == counts.rows_kept + n_rejected, "row accounting broke"
    return {
        "shard": chunk.index,
        "chunk": chunk.to_dict(),
        "rows_in": counts.rows_in,
        "blank_lines": counts.blank_lines,
        "split_extra": counts.split_extra,
        "rows_kept": counts.rows_kept,
        "rows_rejected": n_rejected,
        "needs_response": counts.needs_response,
        "truncated": counts.truncated,
        "tokens_tokenized": counts.tokens_tokenized,
        "tokens": counts.tokens,
        "loss_tokens": counts.loss_tokens,
        "rejects_by_code": dict(sorted(counts.rejects.items())),
        "histogram": counts.histogram,
    }
