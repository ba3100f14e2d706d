"""The shard preparer without Ray: accounting, length policy, rejects."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.assets.templates import load_template
from raypipe.data.output import COUNT_KEYS
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import plan_chunks
from tests.data.bad_corpus import BAD_ROWS, GOOD_ROWS, MAX_LENGTH, MAX_ROW_BYTES, corpus_lines
from tests.helpers import data_config, prepare_lines, prepare_records, qwen_spec

U = {"role": "user", "content": "Hi"}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}]
# The guard of the published Qwen3.5 templates: a system message anywhere but first is refused.
SYSTEM_FIRST_ONLY = load_template("chatml").replace(
    "{%- for message in messages %}",
    "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}",
)


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


def with_role(fmt: str, role: str, tools: bool = False) -> dict:
    """A conversation with an instruction turn spelled `role` first and again after the first reply."""
    dialogue = [
        (role, "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
        (role, "Now in French."),
        ("user", "3+3?"),
        ("assistant", "six"),
    ]
    if fmt == "openai":
        record = {"id": "r", "messages": [{"role": r, "content": text} for r, text in dialogue]}
        return {**record, "tools": TOOLS} if tools else record
    names = {"user": "human", "assistant": "gpt"}
    return {"id": "r", "conversations": [{"from": names.get(r, r), "value": text} for r, text in dialogue]}


@pytest.mark.parametrize(
    "fmt, template, tools",
    [
        ("openai", "qwen_strict", False),  # per-turn rows; a later system turn rendered in place
        ("openai", "qwen_strict", True),  # the leading system turn goes into the tools block
        ("openai", "chatml", False),  # one render; the role name is written out
        ("sharegpt", "qwen_strict", False),
        ("sharegpt", "chatml", False),
    ],
)
def test_developer_rows_and_masks_are_those_of_system(tmp_path, fmt, template, tools):
    results = {
        role: prepare_records(tmp_path, [with_role(fmt, role, tools)], chat_template=template)
        for role in ("system", "developer")
    }
    rows = {role: result.table.to_pylist() for role, result in results.items()}
    assert rows["developer"] == rows["system"] and rows["system"]  # ids, tokens, loss masks, prompt lengths
    assert not results["developer"].rejects and not results["system"].rejects
    tok, _ = qwen_spec(template)
    text = tok.decode(rows["developer"][-1]["input_ids"])
    assert "<|im_start|>system\nNow in French.<|im_end|>" in text and "developer" not in text


def test_a_misplaced_developer_turn_gets_the_reject_of_a_misplaced_system_turn(tmp_path):
    (tmp_path / "system_first_only.jinja").write_text(SYSTEM_FIRST_ONLY)
    template = str(tmp_path / "system_first_only.jinja")
    rejects = {}
    for role in ("system", "developer"):
        records = [with_role("openai", role), with_role("sharegpt", role)]
        result = prepare_records(tmp_path, records, chat_template=template)
        assert result.table.num_rows == 0
        rejects[role] = [(r["stage"], r["code"], r["reason"]) for r in result.rejects]
    assert rejects["developer"] == rejects["system"]
    assert rejects["system"] == 2 * [
        ("render", "template_error", "template refused the conversation: System message must be at the beginning.")
    ]
    leading = {"messages": [{"role": "developer", "content": "Be brief."}, U, {"role": "assistant", "content": "4"}]}
    assert prepare_records(tmp_path, [leading], chat_template=template).table.num_rows == 1
