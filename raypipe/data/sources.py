"""Input files on any fsspec filesystem, planned into deterministic chunks.

A chunk is the unit of work and of output: one chunk becomes one Parquet
shard with a name fixed by its position in the plan. Each file is first cut
into ranges of at most the shard budget (`chunk_bytes`): plain JSONL into
byte ranges (a line belongs to the range holding its first byte), gzip the
same over its decompressed bytes, a Parquet file into its row groups (never
cut; their uncompressed bytes count). Then consecutive ranges of one source,
in plan order, share a chunk while their bytes stay within the budget: small
files share shards, so the file count does not set the shard count (each
shard costs output files, a Ray call and a batch started afresh), while a
large file's full ranges stay one chunk each. Only a single range larger
than the budget (a big row group) makes a larger chunk. A chunk never spans
two sources: its rows carry the source's name and format. Rows keep their
own file and position whatever chunk holds them.

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
planned as one range, so the failure is reported by the chunk that owns it.
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
from raypipe.storage import filesystem, is_url, package_name

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz", ".parquet": "parquet"}
# Errors that mean the file's bytes are unusable (gzip.BadGzipFile is an OSError, a truncated gzip an EOFError).
READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)
_BLOCK = 1 << 20  # bytes per read when skipping an oversized line


@dataclass(frozen=True)
class FileRange:
    """Part of one input file: a whole small file, or a range of a large one."""

    url: str  # file URL with protocol, local path, or name in the job's package (raypipe.storage.package_name)
    kind: str  # jsonl | jsonl.gz | parquet
    start: int  # byte offset (jsonl, decompressed for jsonl.gz) or row group (parquet)
    end: int  # exclusive byte offset or row group + 1


@dataclass(frozen=True)
class Chunk:
    index: int  # position in the plan: names the output shard
    source: str  # dataset name
    format: str  # declared format or "auto"
    files: tuple[FileRange, ...]  # read in this order

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, as plan.json holds it (lists, not tuples: a plan read back compares equal)."""
        return {
            "index": self.index,
            "source": self.source,
            "format": self.format,
            "files": [asdict(f) for f in self.files],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Chunk:
        """The chunk `to_dict` wrote (plan.json, a Ray Data row)."""
        return cls(d["index"], d["source"], d["format"], tuple(FileRange(**f) for f in d["files"]))


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
    # a local file in the job's working-dir package by its place there (raypipe.storage.package_name)
    as_url = (lambda p: fs.unstrip_protocol(p)) if is_url(source.path) else package_name
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


def _file_ranges(url: str, storage_options: dict[str, Any], chunk_bytes: int) -> list[tuple[FileRange, int]]:
    """The file cut into ranges of at most `chunk_bytes` (a Parquet row group is never cut), each with its bytes."""
    fs, path = filesystem(url, storage_options)
    kind = file_kind(url)
    assert kind is not None, url
    if kind == "parquet":
        try:
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
        except READ_ERRORS:
            return [(FileRange(url, kind, 0, 1), fs.size(path))]  # unreadable: one range, whose read names the file
        return [(FileRange(url, kind, g, g + 1), meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
    if kind == "jsonl":
        ranges = _ranges(fs.size(path), chunk_bytes)
    else:
        size, damaged = _gzip_size(fs, path)
        ranges = _ranges(size, chunk_bytes)
        if damaged:
            # The last range reads one byte past the readable part: its chunk meets the error, naming the file.
            ranges[-1] = (ranges[-1][0], size + 1)
    return [(FileRange(url, kind, start, end), end - start) for start, end in ranges]


def _pack(ranges: list[tuple[FileRange, int]], chunk_bytes: int) -> list[list[FileRange]]:
    """Consecutive ranges grouped while their bytes stay within `chunk_bytes`; a range larger than that (a Parquet row
    group) is a group of its own."""
    groups: list[list[FileRange]] = []
    size = 0  # bytes of the last group
    for file_range, n in ranges:
        if not groups or size + n > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(file_range)
        size += n
    return groups


def plan_chunks(sources: list[SourceConfig], storage_options: dict[str, Any], chunk_bytes: int) -> list[Chunk]:
    """Every source's files cut into ranges and packed into chunks of at most `chunk_bytes`, in a fixed order."""
    chunks: list[Chunk] = []
    for source in sources:
        ranges = [
            r for url in list_files(source, storage_options) for r in _file_ranges(url, storage_options, chunk_bytes)
        ]
        for group in _pack(ranges, chunk_bytes):
            chunks.append(Chunk(len(chunks), source.source_name, source.format, tuple(group)))
    return chunks


def read_range(
    file_range: FileRange, storage_options: dict[str, Any], max_row_bytes: int
) -> Iterator[tuple[int, bytes | Oversized | dict[str, Any]]]:
    """(position, raw row): a line's byte offset and bytes (or `Oversized`), or a Parquet row's index and dict.

    Raises `UnreadableFile` when the file's bytes cannot be read, after the rows read before the error.
    """
    try:
        yield from _read(file_range, storage_options, max_row_bytes)
    except READ_ERRORS as err:
        raise UnreadableFile(file_range.url, err) from err


def read_chunk(
    chunk: Chunk, storage_options: dict[str, Any], max_row_bytes: int
) -> Iterator[tuple[int, bytes | Oversized | dict[str, Any]]]:
    """`read_range` over the chunk's files in turn, for readers that need only the rows: an `UnreadableFile` ends it
    (the data stage reads range by range, so one bad file does not hide the next)."""
    for file_range in chunk.files:
        yield from read_range(file_range, storage_options, max_row_bytes)


def _read(
    file_range: FileRange, storage_options: dict[str, Any], max_row_bytes: int
) -> Iterator[tuple[int, bytes | Oversized | dict[str, Any]]]:
    fs, path = filesystem(file_range.url, storage_options)
    start, end = file_range.start, file_range.end
    if file_range.kind == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            first = sum(pf.metadata.row_group(g).num_rows for g in range(start))
            for i, row in enumerate(pf.read_row_group(start).to_pylist()):
                yield first + i, row
        return
    compression = "gzip" if file_range.kind == "jsonl.gz" else None
    with fs.open(path, "rb", compression=compression) as opened:
        # fsspec's remote files (s3fs) take no size in readline; a standard buffer over them does
        f = opened if isinstance(opened, io.BufferedIOBase) else io.BufferedReader(opened, _BLOCK)
        pos = 0
        if start > 0:
            f.seek(start - 1)
            pos = start - 1 + _skip_line(f)  # the line that began in the previous range
        while pos < end:
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
