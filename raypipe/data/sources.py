"""Input files on any fsspec filesystem, planned into deterministic chunks.

A chunk is the unit of work and of output: one chunk becomes one Parquet
shard with a name fixed by its position in the plan. Plain JSONL is split
into byte ranges (a line belongs to the range holding its first byte), a
Parquet file is one chunk per row group.

Gzip is split by rows too, so no gzip file is one shard held whole in
memory: planning streams each file once to learn its decompressed size,
and the decompressed stream is cut into byte ranges by the JSONL rule. A
gzip stream cannot be entered in the middle, so reading a range decompresses
(and discards) everything before it: the price of bounded memory and of
parallel reads within one file, paid in CPU, never in memory.

Rows are read as raw bytes, at most `max_row_bytes + 1` at a time: a longer
line is skipped to its next newline without being held, and comes back as
`Oversized` (its head and length), so invalid UTF-8, malformed JSON and huge
lines are rejected per row instead of failing a whole file.

A file that cannot be read (a truncated or non-gzip `.gz`, an empty or
corrupt Parquet file) raises `UnreadableFile` naming it; rows read before
the error were already yielded. A Parquet file whose footer cannot be read is
planned as one chunk, so the failure is reported by the chunk that owns it.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.config import SourceConfig
from raypipe.storage import filesystem, is_url

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz", ".parquet": "parquet"}
# Errors that mean the file's bytes are unusable (gzip.BadGzipFile is an OSError, a truncated gzip an EOFError).
READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)
_BLOCK = 1 << 20  # bytes per read when skipping an oversized line


@dataclass(frozen=True)
class Chunk:
    index: int  # position in the plan: names the output shard
    source: str  # dataset name
    format: str  # declared format or "auto"
    url: str  # file URL with protocol
    kind: str  # jsonl | jsonl.gz | parquet
    start: int  # byte offset (jsonl, decompressed for jsonl.gz) or row group (parquet)
    end: int  # exclusive byte offset or row group + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Oversized:
    """A line longer than the row limit, skipped without being held: its first bytes and its length."""

    head: bytes
    size: int


class UnreadableFile(Exception):
    """The file's bytes cannot be read: the file is named, rows read before the error stand."""

    def __init__(self, url: str, err: BaseException) -> None:
        super().__init__(f"{url}: {type(err).__name__}: {err}")
        self.url = url
        self.reason = f"{type(err).__name__}: {err}"


def file_kind(path: str) -> str | None:
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if path.endswith(suffix):
            return kind
    return None


def _listing(source: SourceConfig, storage_options: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(files with a known suffix, other files) of a source, both sorted, as URLs."""
    fs, path = filesystem(source.path, storage_options)
    if any(c in path for c in "*?["):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = fs.find(path)
    elif fs.exists(path):
        found = [path]
    else:
        raise ValueError(
            f"data.sources: {source.path} does not exist; fix the path (globs like dir/*.jsonl are allowed)"
        )
    files = [p for p in found if not fs.isdir(p)]
    as_url = (lambda p: fs.unstrip_protocol(p)) if is_url(source.path) else (lambda p: p)
    return sorted(as_url(p) for p in files if file_kind(p)), sorted(as_url(p) for p in files if not file_kind(p))


def list_files(source: SourceConfig, storage_options: dict[str, Any]) -> list[str]:
    """Sorted data files of a source; a clear error when nothing usable matches."""
    files, others = _listing(source, storage_options)
    if not files:
        raise ValueError(
            f"data.sources: no .jsonl, .jsonl.gz or .parquet files match {source.path} "
            f"({len(others)} other entries); fix the path or the file suffixes"
        )
    return files


def check_sources(sources: list[SourceConfig], storage_options: dict[str, Any]) -> None:
    """Raise `list_files`' error for a source that matches no data file: called before Ray starts, so a wrong path
    fails in a second rather than after the cluster and the tokenizer."""
    for source in sources:
        list_files(source, storage_options)


def unmatched_files(sources: list[SourceConfig], storage_options: dict[str, Any]) -> list[str]:
    """Files the sources' paths reach that are not read (another suffix, e.g. .JSONL or .jsonl.zst)."""
    return sorted({url for source in sources for url in _listing(source, storage_options)[1]})


def _gzip_size(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, bool]:
    """(decompressed bytes readable, whether the stream is damaged), streaming the file once."""
    size = 0
    try:
        with fs.open(path, "rb", compression="gzip") as f:
            while block := f.read1(
                _BLOCK
            ):  # read1: bytes decompressed before an error are counted, not dropped with the call
                size += len(block)
    except READ_ERRORS:
        return size, True
    return size, False


def _ranges(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_bytes, size)) for s in range(0, max(size, 1), chunk_bytes)]


def plan_chunks(sources: list[SourceConfig], storage_options: dict[str, Any], chunk_bytes: int) -> list[Chunk]:
    """Every source file cut into chunks, in a fixed order."""
    chunks: list[Chunk] = []
    for source in sources:
        for url in list_files(source, storage_options):
            fs, path = filesystem(url, storage_options)
            kind = file_kind(url)
            if kind == "jsonl":
                ranges = _ranges(fs.size(path), chunk_bytes)
            elif kind == "jsonl.gz":
                size, damaged = _gzip_size(fs, path)
                ranges = _ranges(size, chunk_bytes)
                if damaged:
                    # The last range reads one byte past the readable part: its chunk meets the error, naming the file.
                    ranges[-1] = (ranges[-1][0], size + 1)
            else:
                try:
                    with fs.open(path, "rb") as f:
                        groups = pq.ParquetFile(f).num_row_groups
                except READ_ERRORS:
                    groups = 1  # unreadable: one chunk, whose read fails and names the file
                ranges = [(g, g + 1) for g in range(groups)]
            for start, end in ranges:
                chunks.append(Chunk(len(chunks), source.source_name, source.format, url, kind, start, end))
    return chunks


def read_chunk(
    chunk: Chunk, storage_options: dict[str, Any], max_row_bytes: int
) -> Iterator[tuple[int, bytes | Oversized | dict[str, Any]]]:
    """(position, raw row): a line's byte offset and bytes (or `Oversized`), or a Parquet row's index and dict.

    Raises `UnreadableFile` when the file's bytes cannot be read, after the rows read before the error.
    """
    try:
        yield from _read(chunk, storage_options, max_row_bytes)
    except READ_ERRORS as err:
        raise UnreadableFile(chunk.url, err) from err


def _read(
    chunk: Chunk, storage_options: dict[str, Any], max_row_bytes: int
) -> Iterator[tuple[int, bytes | Oversized | dict[str, Any]]]:
    fs, path = filesystem(chunk.url, storage_options)
    if chunk.kind == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            first = sum(pf.metadata.row_group(g).num_rows for g in range(chunk.start))
            for i, row in enumerate(pf.read_row_group(chunk.start).to_pylist()):
                yield first + i, row
        return
    compression = "gzip" if chunk.kind == "jsonl.gz" else None
    with fs.open(path, "rb", compression=compression) as opened:
        # fsspec's remote files (s3fs) take no size in readline; a standard buffer over them does
        f = opened if isinstance(opened, io.BufferedIOBase) else io.BufferedReader(opened, _BLOCK)
        pos = 0
        if chunk.start > 0:
            f.seek(chunk.start - 1)
            pos = chunk.start - 1 + _skip_line(f)  # the line that began in the previous chunk
        while pos < chunk.end:
            line = f.readline(max_row_bytes + 1)
            if not line:
                break
            if len(line) > max_row_bytes and not line.endswith(b"\n"):
                size = len(line) + _skip_line(f)
                yield pos, Oversized(line[:4096], size)
                pos += size
                continue
            yield pos, line
            pos += len(line)


def _skip_line(f: IO[bytes]) -> int:
    """Read through the next newline (or the end) in bounded blocks; the bytes consumed."""
    n = 0
    while True:
        block = f.readline(_BLOCK)
        n += len(block)
        if not block or block.endswith(b"\n"):
            return n
