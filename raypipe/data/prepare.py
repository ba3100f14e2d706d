"""One chunk of raw rows -> prepared token rows, rejects and counts (no Ray here).

Rows are parsed, normalized, given a placeholder reply where they have none,
rendered and cut at mask boundaries one by one (cheap), then tokenized
`batch_rows` at a time with one batched tokenizer call (the expensive part),
and assembled with numpy so the stage runs near the tokenizer's own speed.

Accounting: every non-blank input row becomes one candidate row, or several
when a history-rewriting template forces per-turn rows (`split_extra`);
`rows_in + split_extra == rows_kept + rows_rejected` always holds, and every
rejected candidate has a reject record.

Nothing in one row can fail the shard: any exception while parsing,
normalizing or rendering it becomes a reject with a stable code
(`too_deep`, `int_too_large`, else `internal_error` naming the exception),
and a batched tokenizer call that fails is redone row by row, the rows that
still fail rejected. A file that cannot be read adds a file-level reject
record (`"level": "file"`, code `unreadable_file`, the file and the error)
and counts in `files_rejected`, not in the row counts; rows read before the
error count as usual, and the chunk's other files are read all the same.
Raw rows in reject records are cut to their first 4 KiB (`raw_truncated`,
`raw_bytes`; raypipe.data.rejects): file and position find the whole row.

A chunk may hold several small files: each row keeps its own file and
position (its fallback `sample_id`, its reject record), so a row prepared in
a shared chunk is the row prepared from its file alone.

A per-turn row (history-rewriting templates) whose prompt alone reaches
`max_length` tokens cannot keep a supervised token, so it is rejected before
tokenizing, with the code the length policy would give. Its prompt is
counted piece by piece between special tokens, which the tokenizer splits
on before anything else, so the count is exact and each message's text is
tokenized once per input row: the turns of a long conversation no longer
cost the square of its length.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from raypipe.config import DataConfig
from raypipe.data.formats import Reject, normalize
from raypipe.data.rejects import Raw, reject_record, safe, tokenizer_reject
from raypipe.data.render import ChatRenderer, Segmented
from raypipe.data.sources import Chunk, FileRange, Oversized, UnreadableFile, read_range
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
SCREEN_CHARS = 1 << 20  # per-turn rows of one conversation holding more text are screened for length untokenized


@dataclass
class ShardResult:
    table: pa.Table
    rejects: list[dict[str, Any]]
    stats: dict[str, Any]


@dataclass
class _Pending:
    sample_id: str
    url: str
    position: int
    raw: Raw
    rows: list[Segmented]


@dataclass
class _Counts:
    rows_in: int = 0
    blank_lines: int = 0
    split_extra: int = 0
    rows_kept: int = 0
    needs_response: int = 0
    tokens_tokenized: int = 0  # of every row that reached the tokenizer, before the length policy (throughput)
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    rejects: Counter = field(default_factory=Counter)
    files_rejected: list[dict[str, str]] = field(default_factory=list)
    histogram: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_EDGES) + 1))


def fit_length(
    mask: np.ndarray, prompt_len: int, needs_response: bool, max_length: int, policy: str
) -> tuple[int, int]:
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
            raise Reject(
                "length",
                "prompt_too_long",
                f"prompt has {prompt_len} tokens, data.max_length {max_length} leaves no room for the reply",
            )
        return max_length, prompt_len
    kept = mask[:max_length]
    ones = np.flatnonzero(kept)
    if len(ones) == 0:
        raise Reject("length", "no_loss_in_window", f"no supervised token within the first {max_length} of {n} tokens")
    if prompt_len >= max_length:  # the last turn was cut: its prompt ends where the last kept supervised run starts
        starts = np.flatnonzero(np.diff(kept.astype(np.int8), prepend=0) == 1)
        prompt_len = int(starts[-1])
    return max_length, prompt_len


def prompt_reject(prompt_tokens: int, needs_response: bool, max_length: int, policy: str) -> Reject:
    """What `fit_length` decides for a row whose prompt alone has `prompt_tokens` >= max_length (at least; counting
    stopped there)."""
    if policy == "reject":
        return Reject(
            "length",
            "too_long",
            f"the prompt alone has {prompt_tokens}+ tokens > data.max_length {max_length} (data.overlength=reject)",
        )
    if needs_response:
        return Reject(
            "length",
            "prompt_too_long",
            f"prompt has {prompt_tokens}+ tokens, data.max_length {max_length} leaves no room for the reply",
        )
    return Reject(
        "length",
        "no_loss_in_window",
        f"the prompt alone has {prompt_tokens}+ tokens: no supervised token within the first {max_length}",
    )


def as_reject(stage: str, err: Exception) -> Reject:
    """Any failure on one row, as a reject with a stable code."""
    if isinstance(err, Reject):
        return err
    if isinstance(err, RecursionError):
        return Reject(stage, "too_deep", "nested deeper than Python's recursion limit allows")
    if isinstance(err, ValueError) and "integer string conversion" in str(err):
        return Reject(stage, "int_too_large", f"an integer with more digits than Python converts: {err}")
    return Reject(stage, "internal_error", f"{type(err).__name__}: {err}")


def fallback_id(url: str, position: int) -> str:
    """Stable id for rows without one: the file and the row's position in it."""
    return hashlib.sha1(f"{url}:{position}".encode()).hexdigest()[:20]


class ShardPreparer:
    """Holds one tokenizer and template; prepares chunks one after another."""

    def __init__(self, cfg: DataConfig, spec: TokenizerSpec) -> None:
        self.cfg = cfg
        self.backend = Tokenizer.from_str(spec.tokenizer_json)
        self.renderer = ChatRenderer.of(spec, cfg.placeholder_reply)
        self.splits = _special_splitter(self.backend)

    def prepare(self, chunk: Chunk) -> ShardResult:
        counts = _Counts()
        rejects: list[dict[str, Any]] = []
        batches: list[pa.RecordBatch] = []
        pending: list[_Pending] = []
        for file_range in chunk.files:
            for p in self._rows(chunk, file_range, counts, rejects):
                pending.append(p)
                if len(pending) >= self.cfg.batch_rows:
                    batches.append(self._tokenize(chunk, pending, counts, rejects))
                    pending = []
        if pending:
            batches.append(self._tokenize(chunk, pending, counts, rejects))
        table = pa.Table.from_batches(batches, schema=PREPARED_SCHEMA)
        return ShardResult(table, rejects, _stats(chunk, counts, len(rejects) - len(counts.files_rejected)))

    def _rows(
        self, chunk: Chunk, file_range: FileRange, counts: _Counts, rejects: list[dict[str, Any]]
    ) -> Iterator[_Pending]:
        """The range's rows parsed, normalized and rendered, ready to tokenize; rows that fail here are rejected. An
        unreadable file is recorded and ends only its own range."""
        url, rows_before = file_range.url, counts.rows_in
        try:
            for position, raw in read_range(file_range, self.cfg.storage_options, self.cfg.max_row_bytes):
                if isinstance(raw, bytes) and not raw.strip():
                    counts.blank_lines += 1
                    continue
                counts.rows_in += 1
                sample_id, stage = fallback_id(url, position), "parse"
                try:
                    record = self._parse(raw)
                    stage = "normalize"
                    conv = normalize(record, chunk.format)
                    sample_id = conv.id or sample_id
                    stage = "render"
                    rows = self.renderer.segment(conv, isinstance(raw, bytes) and self.renderer.spells_no_special(raw))
                except Exception as err:  # noqa: BLE001 - one row never fails the shard: every failure is a reject
                    _add_reject(chunk, url, sample_id, position, raw, as_reject(stage, err), counts, rejects)
                    continue
                counts.split_extra += len(rows) - 1
                rows = self._drop_unfit_turns(chunk, url, sample_id, position, raw, rows, counts, rejects)
                if rows:
                    yield _Pending(sample_id, url, position, raw, rows)
        except UnreadableFile as err:
            counts.files_rejected.append({"file": err.url, "reason": err.reason})
            rejects.append(
                {
                    "level": "file",
                    "source": chunk.source,
                    "file": err.url,
                    "stage": "read",
                    "code": "unreadable_file",
                    "reason": (
                        f"{safe(err.reason)}; the {counts.rows_in - rows_before} rows this shard read from the file "
                        "before the error are counted as usual"
                    ),
                }
            )

    def _drop_unfit_turns(
        self,
        chunk: Chunk,
        url: str,
        sample_id: str,
        position: int,
        raw: Raw,
        rows: list[Segmented],
        counts: _Counts,
        rejects: list[dict[str, Any]],
    ) -> list[Segmented]:
        """Per-turn rows whose prompt alone reaches max_length, rejected before they are tokenized, when the rows'
        text is large enough for that to matter (it grows with the square of the turns); below SCREEN_CHARS the
        length policy rejects them after tokenization with the same codes, without counting each prompt twice."""
        if rows[0].turn is None or sum(len(text) for seg in rows for text, _ in seg.pieces) < SCREEN_CHARS:
            return rows
        known: dict[str, int] = {}  # text between special tokens -> tokens, shared by the turns of this row
        kept = []
        for seg in rows:
            n = self.prompt_tokens(seg, known)
            if n < self.cfg.max_length:
                kept.append(seg)
            else:
                rej = prompt_reject(n, seg.needs_response, self.cfg.max_length, self.cfg.overlength)
                _add_reject(chunk, url, f"{sample_id}#{seg.turn}", position, raw, rej, counts, rejects)
        return kept

    def prompt_tokens(self, seg: Segmented, known: dict[str, int]) -> int:
        """Tokens of the row's prompt, exact, or a count that already reached max_length when it stopped."""
        total = 0
        for text, _ in seg.pieces[: seg.prompt_pieces]:
            for part in self.splits.split(text):
                if part:
                    if part not in known:
                        known[part] = len(self.backend.encode(part, add_special_tokens=False).ids)
                    total += known[part]
                    if total >= self.cfg.max_length:
                        return total
        return total

    def _parse(self, raw: Raw) -> Any:
        if isinstance(raw, dict):
            return raw
        if isinstance(raw, Oversized) or len(raw) > self.cfg.max_row_bytes:
            size = raw.size if isinstance(raw, Oversized) else len(raw)
            raise Reject("read", "oversized_row", f"row has {size} bytes > data.max_row_bytes {self.cfg.max_row_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise Reject("parse", "invalid_utf8", f"invalid UTF-8 at byte {err.start}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise Reject("parse", "invalid_json", f"malformed JSON: {err.msg} at column {err.colno}") from None

    def _encode_rows(self, rows: list[Segmented]) -> list[list[int]]:
        """The ids of every piece of these rows, in order, each piece tokenized on its own as if alone (no token
        crosses a piece).

        Each distinct piece of the render-once rows is encoded once per call, with the batch call that computes no
        offsets (a prompt-only row's placeholder tail is the same text in every row). Per-turn rows repeat their
        conversation's history, so theirs are put together from the texts between special tokens (a text's tokens
        are its parts' tokens end to end, as the tokenizer splits there first), each distinct part encoded once per
        call: their cost grows with the conversation, not with the square of its turns."""
        whole = list(dict.fromkeys(text for seg in rows if seg.turn is None for text, _ in seg.pieces))
        ids = {text: e.ids for text, e in zip(whole, self.backend.encode_batch_fast(whole, add_special_tokens=False))}
        split = self._split_pieces([seg for seg in rows if seg.turn is not None])
        if split:
            parts = self._encode_parts(split)
            for text, text_parts in split.items():
                ids[text] = list(chain.from_iterable(parts[part] for part in text_parts))
        return [ids[text] for seg in rows for text, _ in seg.pieces]

    def _split_pieces(self, rows: list[Segmented]) -> dict[str, list[str]]:
        """Each distinct piece text of these rows, cut into its non-empty texts between special tokens (once: the
        rows of one conversation repeat its history)."""
        texts = dict.fromkeys(text for seg in rows for text, _ in seg.pieces)
        return {text: [part for part in self.splits.split(text) if part] for text in texts}

    def _encode_parts(self, split: dict[str, list[str]]) -> dict[str, list[int]]:
        """The ids of every distinct text between special tokens, from one batched call."""
        distinct = list(dict.fromkeys(part for parts in split.values() for part in parts))
        return {
            part: e.ids for part, e in zip(distinct, self.backend.encode_batch_fast(distinct, add_special_tokens=False))
        }

    def _encode(
        self, chunk: Chunk, pending: list[_Pending], counts: _Counts, rejects: list[dict[str, Any]]
    ) -> tuple[list[_Pending], list[list[int]]]:
        """(rows the tokenizer took, the ids of their pieces): one batched call, or row by row when it fails."""
        try:
            return pending, self._encode_rows([seg for p in pending for seg in p.rows])
        except Exception:  # noqa: BLE001 - one bad text fails the whole call; find it row by row
            pass
        kept, encoded = [], []
        for p in pending:
            try:
                encoded.extend(self._encode_rows(p.rows))
            except Exception as err:  # noqa: BLE001 - the row is rejected with the tokenizer's reason
                texts = [text for seg in p.rows for text, _ in seg.pieces]
                rej = tokenizer_reject(texts, err)
                for seg in p.rows:
                    _add_reject(
                        chunk,
                        p.url,
                        p.sample_id if seg.turn is None else f"{p.sample_id}#{seg.turn}",
                        p.position,
                        p.raw,
                        rej,
                        counts,
                        rejects,
                    )
                continue
            kept.append(p)
        return kept, encoded

    def _tokenize(
        self, chunk: Chunk, pending: list[_Pending], counts: _Counts, rejects: list[dict[str, Any]]
    ) -> pa.RecordBatch:
        """One batched tokenizer call for every row, then numpy assembly: Python looks at a row on its own only when
        it is over `max_length`, so the per-row cost stays small beside the tokenizer's."""
        pending, encoded = self._encode(chunk, pending, counts, rejects)
        rows = [(p, seg) for p in pending for seg in p.rows]
        pieces = np.fromiter((len(seg.pieces) for _, seg in rows), dtype=np.int64, count=len(rows))
        n_pieces = int(pieces.sum())
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n_pieces)
        flat = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum()))
        supervised = np.fromiter((sup for _, seg in rows for _, sup in seg.pieces), dtype=np.int8, count=n_pieces)
        mask = np.repeat(supervised, lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)])  # token offset of each piece
        loss_before = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])  # supervised tokens before each position
        counts.tokens_tokenized += len(flat)

        first = np.concatenate([[0], np.cumsum(pieces)])  # first piece of each row, and the end
        prompt_pieces = np.fromiter((seg.prompt_pieces for _, seg in rows), dtype=np.int64, count=len(rows))
        start, end = offsets[first[:-1]], offsets[first[1:]]
        size, prompt_len = end - start, offsets[first[:-1] + prompt_pieces] - start
        row_ids = [p.sample_id if seg.turn is None else f"{p.sample_id}#{seg.turn}" for p, seg in rows]
        for i in np.flatnonzero(size > self.cfg.max_length):  # the length policy, row by row where it applies
            (p, seg), a, b = rows[i], int(start[i]), int(end[i])
            try:
                n, prompt_len[i] = fit_length(
                    mask[a:b], int(prompt_len[i]), seg.needs_response, self.cfg.max_length, self.cfg.overlength
                )
            except Reject as rej:
                _add_reject(chunk, p.url, row_ids[i], p.position, p.raw, rej, counts, rejects)
                size[i] = -1
                continue
            counts.truncated += n < b - a
            size[i] = n

        kept = np.flatnonzero(size >= 0)
        start, size = start[kept], size[kept]
        list_offsets = np.concatenate([[0], np.cumsum(size)])
        if list_offsets[-1] == len(flat):  # every row kept whole: no gather
            ids_out, mask_out = flat, mask
        else:
            take = np.arange(list_offsets[-1]) + np.repeat(start - list_offsets[:-1], size)
            ids_out, mask_out = flat[take], mask[take]
        n_loss = loss_before[start + size] - loss_before[start]
        needs_response = np.fromiter((seg.needs_response for _, seg in rows), dtype=bool, count=len(rows))[kept]
        counts.rows_kept += len(kept)
        counts.needs_response += int(needs_response.sum())
        counts.tokens += int(size.sum())
        counts.loss_tokens += int(n_loss.sum())
        histogram = np.bincount(np.searchsorted(HISTOGRAM_EDGES, size), minlength=len(HISTOGRAM_EDGES) + 1)
        counts.histogram = [a + int(b) for a, b in zip(counts.histogram, histogram, strict=True)]
        offsets_arr = pa.array(list_offsets.astype(np.int32))
        arrays = {
            "sample_id": pa.array([row_ids[i] for i in kept], type=pa.string()),
            "source": pa.array([chunk.source] * len(kept), type=pa.string()),
            "input_ids": pa.ListArray.from_arrays(offsets_arr, pa.array(ids_out)),
            "loss_mask": pa.ListArray.from_arrays(offsets_arr, pa.array(mask_out)),
            "num_tokens": pa.array(size.astype(np.int32)),
            "num_loss_tokens": pa.array(n_loss.astype(np.int32)),
            "needs_response": pa.array(needs_response),
            "prompt_len": pa.array(prompt_len[kept].astype(np.int32)),
        }
        return pa.RecordBatch.from_arrays([arrays[f.name] for f in PREPARED_SCHEMA], schema=PREPARED_SCHEMA)


def _special_splitter(backend: Tokenizer) -> re.Pattern[str]:
    """Splits text at the added tokens the tokenizer itself splits on first (verbatim ones), keeping them as parts.

    Text between two such tokens is tokenized on its own, so a text's token count is the sum of its parts'. Read from
    the loaded tokenizer: parsing its JSON again took as long as loading it (about 0.4 s per actor for Qwen's).
    """
    verbatim = [
        t.content
        for t in backend.get_added_tokens_decoder().values()
        if not (t.lstrip or t.rstrip or t.single_word or t.normalized)
    ]
    return re.compile("(" + ("|".join(map(re.escape, sorted(verbatim, key=len, reverse=True))) or "(?!)") + ")")


def _add_reject(
    chunk: Chunk,
    url: str,
    sample_id: str,
    position: int,
    raw: Raw,
    rej: Reject,
    counts: _Counts,
    rejects: list[dict[str, Any]],
) -> None:
    rejects.append(reject_record(chunk, url, sample_id, position, raw, rej))
    counts.rejects[rej.code] += 1


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
        "files_rejected": counts.files_rejected,
        "needs_response": counts.needs_response,
        "truncated": counts.truncated,
        "tokens_tokenized": counts.tokens_tokenized,
        "tokens": counts.tokens,
        "loss_tokens": counts.loss_tokens,
        "rejects_by_code": dict(sorted(counts.rejects.items())),
        "histogram": counts.histogram,
    }
