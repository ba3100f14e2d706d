"""The planner: files cut into ranges of at most the budget, consecutive ranges of a source packed into chunks."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.data.sources import Chunk, plan_chunks
from tests.helpers import data_config

BUDGET = 4096


def write(path: Path, size: int) -> Path:
    """A JSONL file of exactly `size` bytes (lines of up to 100 bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, left = [], size
    while left > 0:
        n = min(100, left)
        lines.append(b"x" * (n - 1) + b"\n")
        left -= n
    path.write_bytes(b"".join(lines))
    return path


def plan(*paths: str | Path, budget: int = BUDGET) -> list[Chunk]:
    return plan_chunks(data_config(sources=[{"path": str(p)} for p in paths]).sources, {}, budget)


def names(chunk: Chunk) -> list[tuple[str, int, int]]:
    return [(Path(f.url).name, f.start, f.end) for f in chunk.files]


def test_ten_thousand_tiny_files_make_a_handful_of_chunks(tmp_path):
    for i in range(10_000):
        write(tmp_path / "in" / f"{i:05d}.jsonl", 40)
    chunks = plan(tmp_path / "in")
    assert len(chunks) == 99  # 102 files of 40 bytes fill 4,080 of the 4,096: 98 full chunks and one of 4 files
    assert [c.index for c in chunks] == list(range(len(chunks)))
    files = [f for c in chunks for f in c.files]
    assert [Path(f.url).name for f in files] == [f"{i:05d}.jsonl" for i in range(10_000)]  # each once, in order
    assert all((f.start, f.end) == (0, 40) for f in files)


def test_a_big_file_is_cut_as_before_and_small_files_around_it_share_chunks(tmp_path):
    write(tmp_path / "a.jsonl", 100)
    write(tmp_path / "b.jsonl", 3 * BUDGET + 1000)
    write(tmp_path / "c.jsonl", 2000)
    write(tmp_path / "d.jsonl", 1000)
    write(tmp_path / "e.jsonl", 2000)
    assert [names(c) for c in plan(tmp_path / "*.jsonl")] == [
        [("a.jsonl", 0, 100)],
        [("b.jsonl", 0, BUDGET)],
        [("b.jsonl", BUDGET, 2 * BUDGET)],
        [("b.jsonl", 2 * BUDGET, 3 * BUDGET)],
        [("b.jsonl", 3 * BUDGET, 3 * BUDGET + 1000), ("c.jsonl", 0, 2000), ("d.jsonl", 0, 1000)],
        [("e.jsonl", 0, 2000)],
    ]


def test_chunks_stay_within_the_budget_cover_every_byte_once_and_are_as_few_as_the_order_allows(tmp_path):
    rng = random.Random(0)
    sizes = {
        f"{i:03d}.jsonl": rng.choice([0, 1, 50, 700, 2000, BUDGET - 1, BUDGET, BUDGET + 1, 3 * BUDGET + 7])
        for i in range(300)
    }
    for name, size in sizes.items():
        write(tmp_path / name, size)
    chunks = plan(tmp_path / "*.jsonl")
    nbytes = [sum(f.end - f.start for f in c.files) for c in chunks]
    assert all(n <= BUDGET for n in nbytes)
    covered: dict[str, list[tuple[int, int]]] = {}
    for f in (f for c in chunks for f in c.files):
        covered.setdefault(Path(f.url).name, []).append((f.start, f.end))
    assert list(covered) == sorted(sizes)  # plan order
    for name, ranges in covered.items():
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[name]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no byte twice
    first = [c.files[0] for c in chunks]
    assert all(n + (f.end - f.start) > BUDGET for n, f in zip(nbytes, first[1:]))  # no chunk could take the next range


def test_the_plan_is_deterministic_and_survives_plan_json(tmp_path):
    for i in range(50):
        write(tmp_path / f"{i:02d}.jsonl", 37 * i)
    chunks = plan(tmp_path)
    assert plan(tmp_path) == chunks
    assert [Chunk.from_dict(json.loads(json.dumps(c.to_dict()))) for c in chunks] == chunks
    assert json.loads(json.dumps([c.to_dict() for c in chunks])) == [c.to_dict() for c in chunks]  # as start() compares


def test_small_gzip_files_and_parquet_row_groups_are_packed_too(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.jsonl.gz").write_bytes(gzip.compress(b'{"instruction": "hi"}\n' * 10))  # 220 bytes each
    table = pa.table({"instruction": [f"task {i}" for i in range(40)]})
    pq.write_table(table, tmp_path / "z.parquet", row_group_size=10)
    [chunk] = plan(tmp_path)
    assert names(chunk) == [(f"{i}.jsonl.gz", 0, 220) for i in range(3)] + [("z.parquet", g, g + 1) for g in range(4)]
    meta = pq.ParquetFile(tmp_path / "z.parquet").metadata
    pair = 2 * max(meta.row_group(g).total_byte_size for g in range(4))  # uncompressed bytes count: 2 x 182
    assert [names(c) for c in plan(tmp_path, budget=pair)] == [
        *([(f"{i}.jsonl.gz", 0, 220)] for i in range(3)),
        [("z.parquet", 0, 1), ("z.parquet", 1, 2)],
        [("z.parquet", 2, 3), ("z.parquet", 3, 4)],
    ]
    assert [names(c) for c in plan(tmp_path, budget=100)][-4:] == [[("z.parquet", g, g + 1)] for g in range(4)]


def test_a_chunk_never_spans_two_sources(tmp_path):
    write(tmp_path / "one" / "a.jsonl", 10)
    write(tmp_path / "two" / "b.jsonl", 10)
    chunks = plan(tmp_path / "one", tmp_path / "two")
    assert [names(c) for c in chunks] == [[("a.jsonl", 0, 10)], [("b.jsonl", 0, 10)]]
    assert [c.index for c in chunks] == [0, 1]
