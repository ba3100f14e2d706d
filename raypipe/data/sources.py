"""Input files on any fsspec filesystem, planned into deterministic chunks.

A chunk is the unit of work and of output: one chunk becomes one Parquet
shard with a name fixed by its position in the plan. Plain JSONL is split
into byte ranges (a line belongs to the range holding its first byte), a
gzip file is one chunk, a Parquet file is one chunk per row group. Rows are
read as raw bytes so invalid UTF-8 and malformed JSON are rejected per row
instead of failing a whole file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from raypipe.config import SourceConfig

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz", ".parquet": "parquet"}


@dataclass(frozen=True)
class Chunk:
    index: int  # position in the plan: names the output shard
    source: str  # dataset name
    format: str  # declared format or "auto"
    url: str  # file URL with protocol
    kind: str  # jsonl | jsonl.gz | parquet
    start: int  # byte offset (jsonl) or row group (parquet)
    end: int  # exclusive byte offset (jsonl) or row group + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def file_kind(path: str) -> str | None:
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if path.endswith(suffix):
            return kind
    return None


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol); fsspec reuses instances per process."""
    return url_to_fs(url, **storage_options)


def list_files(source: SourceConfig, storage_options: dict[str, Any]) -> list[str]:
    """Sorted data files of a source; a clear error when nothing usable matches."""
    fs, path = filesystem(source.path, storage_options)
    if any(c in path for c in "*?["):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = fs.find(path)
    elif fs.exists(path):
        found = [path]
    else:
        raise ValueError(f"data.sources: {source.path} does not exist; fix the path (globs like dir/*.jsonl are allowed)")
    files = sorted(p for p in found if file_kind(p) and not fs.isdir(p))
    if not files:
        raise ValueError(
            f"data.sources: no .jsonl, .jsonl.gz or .parquet files match {source.path} "
            f"({len(found)} other entries); fix the path or the file suffixes"
        )
    return [fs.unstrip_protocol(p) if "://" in source.path else p for p in files]


def plan_chunks(sources: list[SourceConfig], storage_options: dict[str, Any], chunk_bytes: int) -> list[Chunk]:
    """Every source file cut into chunks, in a fixed order."""
    chunks: list[Chunk] = []
    for source in sources:
        for url in list_files(source, storage_options):
            fs, path = filesystem(url, storage_options)
            kind = file_kind(url)
            if kind == "jsonl":
                size = fs.size(path)
                ranges = [(s, min(s + chunk_bytes, size)) for s in range(0, max(size, 1), chunk_bytes)]
            elif kind == "jsonl.gz":
                ranges = [(0, 0)]
            else:
                with fs.open(path, "rb") as f:
                    groups = pq.ParquetFile(f).num_row_groups
                ranges = [(g, g + 1) for g in range(groups)]
            for start, end in ranges:
                chunks.append(Chunk(len(chunks), source.source_name, source.format, url, kind, start, end))
    return chunks


def read_chunk(chunk: Chunk, storage_options: dict[str, Any]) -> Iterator[tuple[int, bytes | dict[str, Any]]]:
    """(position, raw row): the line's byte offset and bytes, or a Parquet row's index and dict."""
    fs, path = filesystem(chunk.url, storage_options)
    if chunk.kind == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            first = sum(pf.metadata.row_group(g).num_rows for g in range(chunk.start))
            for i, row in enumerate(pf.read_row_group(chunk.start).to_pylist()):
                yield first + i, row
        return
    compression = "gzip" if chunk.kind == "jsonl.gz" else None
    with fs.open(path, "rb", compression=compression) as f:
        pos = 0
        if chunk.start > 0:
            f.seek(chunk.start - 1)
            pos = chunk.start - 1 + len(f.readline())  # skip the line that began in the previous chunk
        limit = chunk.end if chunk.kind == "jsonl" else None
        while limit is None or pos < limit:
            line = f.readline()
            if not line:
                break
            yield pos, line
            pos += len(line)
