"""The shard preparer without Ray: accounting, length policy, rejects."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.data.output import COUNT_KEYS
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import plan_chunks
from tests.data.bad_corpus import BAD_ROWS, GOOD_ROWS, MAX_LENGTH, MAX_ROW_BYTES, corpus_lines
from tests.helpers import data_config, prepare_lines, prepare_records, qwen_spec

U = {"role": "user", "content": "Hi"}


def test_bad_corpus_every_kind_rejected_with_its_reason_and_counts_add_up(tmp_path):
    assert len(BAD_ROWS) >= 20
    result = prepare_lines(tmp_path, corpus_lines(), max_row_bytes=MAX_ROW_BYTES, max_length=MAX_LENGTH)
    s = result.stats
    good = len(BAD_ROWS)  # one good row after each bad one
    assert s["rows_in"] == len(BAD_ROWS) + good
    assert s["rows_kept"] == good and s["rows_rejected"] == len(BAD_ROWS)
    assert s["rows_in"] + s["split_extra"] == s["rows_kept"] + s["rows_rejected"]
    assert s["blank_lines"] == 5
    assert Counter(r["code"] for r in result.rejects) == Counter(code for _, code in BAD_ROWS.values())
    for rej in result.rejects:
        assert rej["reason"] and rej["stage"] and rej["sample_id"] and rej["file"].endswith("in.jsonl")
        assert "raw" in rej or "raw_base64" in rej
    by_code = {r["code"]: r for r in result.rejects}
    assert by_code["invalid_utf8"]["raw_base64"]  # the undecodable row is kept byte for byte
    assert json.loads(by_code["unknown_format"]["raw"]) == {"text": "just text"}


def test_truncate_keeps_the_head_and_counts_it(tmp_path):
    long_reply = {"messages": [U, {"role": "assistant", "content": "word " * 300}]}
    [row] = prepare_records(tmp_path, [long_reply], max_length=50).table.to_pylist()
    assert row["num_tokens"] == 50 == len(row["input_ids"]) == len(row["loss_mask"])
    assert row["num_loss_tokens"] == sum(row["loss_mask"]) > 0
    assert row["loss_mask"][row["prompt_len"]] == 1 and row["loss_mask"][row["prompt_len"] - 1] == 0


def test_reject_policy_rejects_over_length(tmp_path):
    result = prepare_records(
        tmp_path,
        [{"messages": [U, {"role": "assistant", "content": "word " * 300}]}],
        max_length=50,
        overlength="reject",
    )
    assert result.table.num_rows == 0
    assert result.rejects[0]["code"] == "too_long" and "data.max_length 50" in result.rejects[0]["reason"]


def test_per_turn_truncation_keeps_turns_that_fit(tmp_path):
    turns = [
        U,
        {"role": "assistant", "content": "short"},
        {"role": "user", "content": "more " * 100},
        {"role": "assistant", "content": "late"},
    ]
    result = prepare_records(tmp_path, [{"id": "s1", "messages": turns}], max_length=40)
    assert [r["sample_id"] for r in result.table.to_pylist()] == ["s1#1"]
    assert [(r["sample_id"], r["code"]) for r in result.rejects] == [("s1#3", "no_loss_in_window")]
    s = result.stats
    assert (s["rows_in"], s["split_extra"], s["rows_kept"], s["rows_rejected"]) == (1, 1, 1, 1)


def test_ids_are_source_ids_or_stable_hashes(tmp_path):
    records = [{"id": "abc", "messages": [U]}, {"messages": [U]}, {"messages": [U]}]
    first = [r["sample_id"] for r in prepare_records(tmp_path, records).table.to_pylist()]
    again = [r["sample_id"] for r in prepare_records(tmp_path, records).table.to_pylist()]
    assert first[0] == "abc" and first == again and len(set(first)) == 3


@pytest.mark.parametrize("line", GOOD_ROWS)
def test_good_rows_are_kept(tmp_path, line):
    result = prepare_lines(tmp_path, [line])
    assert result.table.num_rows >= 1 and not result.rejects


def small_files(root: Path) -> list[Path]:
    """Small files of every kind, in plan order: bad rows among good ones, rows with and without ids, a gzip file
    truncated after some rows, a Parquet file of two row groups, a .gz file that is not gzip."""
    root.mkdir()
    lines = corpus_lines()
    half = len(lines) // 2
    prompts = [
        json.dumps({"messages": [{"role": "user", "content": f"Question {i}: {i * i} or {i**3}?"}]}) for i in range(300)
    ]
    whole = gzip.compress("".join(p + "\n" for p in prompts).encode())
    table = pa.table({"instruction": [f"Task {i}" for i in range(12)], "output": [f"done {i}" for i in range(12)]})
    (root / "0.jsonl").write_bytes(b"\n".join(lines[:half]) + b"\n")
    (root / "1.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (root / "2.jsonl").write_bytes(b"".join(r + b"\n" for r in GOOD_ROWS))
    pq.write_table(table, root / "3.parquet", row_group_size=6)
    (root / "4.jsonl").write_bytes(b"\n".join(lines[half:]) + b"\n")
    (root / "5.jsonl.gz").write_bytes(GOOD_ROWS[0])
    return sorted(root.iterdir())


def test_a_chunk_of_small_files_gives_the_rows_and_rejects_of_the_files_prepared_one_by_one(tmp_path):
    files = small_files(tmp_path / "in")
    limits = {"max_row_bytes": MAX_ROW_BYTES, "max_length": MAX_LENGTH, "batch_rows": 8}  # batches cross files
    cfg = data_config(sources=[{"path": str(tmp_path / "in"), "name": "mix"}], **limits)
    preparer = ShardPreparer(cfg, qwen_spec()[1])
    [chunk] = plan_chunks(cfg.sources, {}, 1 << 20)
    assert [Path(f.url).name for f in chunk.files] == [
        f.name for f in files for _ in range(2 if f.suffix == ".parquet" else 1)
    ]
    grouped = preparer.prepare(chunk)

    alone = []
    for f in files:
        sources = data_config(sources=[{"path": str(f), "name": "mix"}], **limits).sources
        [one] = plan_chunks(sources, {}, 1 << 20)
        alone.append(preparer.prepare(one))
    assert grouped.table.equals(pa.concat_tables([r.table for r in alone]))  # same rows, sample_ids, tokens, in order
    # the same records (files, positions, reasons); a row's length reject waits for its batch, so the order may differ
    assert sorted(map(json.dumps, grouped.rejects)) == sorted(json.dumps(rej) for r in alone for rej in r.rejects)
    s = grouped.stats
    assert {k: s[k] for k in COUNT_KEYS} == {k: sum(r.stats[k] for r in alone) for k in COUNT_KEYS}
    assert s["files_rejected"] == [f for r in alone for f in r.stats["files_rejected"]]
    assert [Path(f["file"]).name for f in s["files_rejected"]] == ["1.jsonl.gz", "5.jsonl.gz"]
    truncated = next(r for r in grouped.rejects if r.get("level") == "file")
    assert (
        alone[1].stats["rows_in"] > 0 and f"the {alone[1].stats['rows_in']} rows this shard read" in truncated["reason"]
    )
    assert alone[4].stats["rows_in"] > 0  # the rows after an unreadable file are read
