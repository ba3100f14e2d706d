"""The synthetic reference corpus: exact counts, declared shapes, determinism, re-runs."""

from __future__ import annotations

import ast
import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.corpus import (
    CATEGORIES,
    REFERENCE_SAMPLES,
    CorpusSpec,
    category_counts,
    format_counts,
    plan_shards,
    write_corpus,
    write_shard,
)
from raypipe.data.formats import FORMATS

SPEC = CorpusSpec(num_samples=10_000, seed=0, rows_per_file=2_500)
OPENAI_ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_FROM = {"system", "human", "gpt", "tool"}
PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("corpus")
    return out, write_corpus(out, SPEC)


def rows(out: Path, fmt: str) -> list[dict[str, Any]]:
    return [
        json.loads(line) for path in sorted((out / fmt).glob("part-*.jsonl")) for line in path.read_text().splitlines()
    ]


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def text(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


# --- shapes ------------------------------------------------------------------------------


def check_openai(row: dict[str, Any]) -> None:
    assert set(row) <= {"id", "messages", "tools"} and text(row["id"])
    tool_names = {t["function"]["name"] for t in row.get("tools", [])}
    for tool in row.get("tools", []):
        assert tool["type"] == "function" and text(tool["function"]["description"])
        assert tool["function"]["parameters"]["type"] == "object"
    messages = row["messages"]
    assert messages and all(m["role"] in OPENAI_ROLES for m in messages)
    assert all(m["role"] != "system" for m in messages[1:]), "system prompt only first"
    for m in messages:
        assert set(m) <= {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"}
        assert isinstance(m["content"], str)
        assert text(m["content"]) or "tool_calls" in m, "only a tool-calling turn may have empty content"
        assert ("tool_call_id" in m) == (m["role"] == "tool")
        assert m["role"] == "assistant" or not {"reasoning_content", "tool_calls"} & set(m)
        assert text(m.get("reasoning_content", "x"))
        for call in m.get("tool_calls", []):
            assert text(call["id"]) and call["type"] == "function" and call["function"]["name"] in tool_names
            args = call["function"]["arguments"]
            assert isinstance(json.loads(args) if isinstance(args, str) else args, dict)


def check_sharegpt(row: dict[str, Any]) -> None:
    assert set(row) == {"id", "conversations"} and text(row["id"])
    turns = row["conversations"]
    assert turns and all(set(t) == {"from", "value"} and t["from"] in SHAREGPT_FROM and text(t["value"]) for t in turns)
    assert all(t["from"] != "system" for t in turns[1:])


def check_alpaca(row: dict[str, Any]) -> None:
    assert set(row) <= {"id", "instruction", "input", "output"} and text(row["instruction"])
    assert all(text(row[k]) for k in ("id", "input", "output") if k in row)


def is_prompt_only(fmt: str, row: dict[str, Any]) -> bool:
    if fmt == "openai":
        return all(m["role"] != "assistant" for m in row["messages"])
    if fmt == "sharegpt":
        return all(t["from"] != "gpt" for t in row["conversations"])
    return "output" not in row


def test_every_row_has_the_declared_shape_and_the_counts_add_up(corpus: tuple[Path, dict[str, int]]) -> None:
    out, counts = corpus
    manifest = json.loads((out / "corpus.json").read_text())
    check = {"openai": check_openai, "sharegpt": check_sharegpt, "alpaca": check_alpaca}
    ids = []
    for fmt in FORMATS:
        data = rows(out, fmt)
        for row in data:
            check[fmt](row)
        ids += [row["id"] for row in data if "id" in row]
        declared = manifest["formats"][fmt]
        assert len(data) == declared["rows"]
        assert sum(is_prompt_only(fmt, r) for r in data) == declared["categories"]["prompt_only"]
    assert len(ids) == len(set(ids)), "ids are unique"
    assert counts == manifest["counts"] == category_counts(SPEC.num_samples)
    assert manifest["complete"] and manifest["total"]["rows"] == SPEC.num_samples
    assert manifest["total"]["bytes"] == sum(p.stat().st_size for p in out.rglob("part-*.jsonl"))
    alpaca = rows(out, "alpaca")
    assert any("id" in r for r in alpaca) and any("id" not in r for r in alpaca), "some Alpaca rows have no id"


def test_prompt_only_rows_are_user_prompts_mixed_into_every_file(corpus: tuple[Path, dict[str, int]]) -> None:
    out, _ = corpus
    for path in out.rglob("part-*.jsonl"):
        data = [json.loads(line) for line in path.read_text().splitlines()]
        prompt_only = [is_prompt_only(path.parent.name, r) for r in data]
        assert any(prompt_only) and not all(prompt_only), f"{path} mixes prompt-only rows with the rest"
    for row in rows(out, "openai"):
        if is_prompt_only("openai", row):
            assert [m["role"] for m in row["messages"]] in (["user"], ["system", "user"])
    for row in rows(out, "sharegpt"):
        if is_prompt_only("sharegpt", row):
            assert [t["from"] for t in row["conversations"]] in (["human"], ["system", "human"])


def test_tool_calls_are_answered_by_tool_messages_with_their_ids(corpus: tuple[Path, dict[str, int]]) -> None:
    out, _ = corpus
    with_tools = [r for r in rows(out, "openai") if "tools" in r]
    assert with_tools
    ends_in_tool_result = 0
    for row in with_tools:
        pending: list[str] = []
        for m in row["messages"]:
            if m["role"] == "tool":
                assert m["tool_call_id"] == pending.pop(0), "tool results answer the calls in order"
            else:
                assert not pending, "every call is answered before the next turn"
                pending = [c["id"] for c in m.get("tool_calls", [])]
        assert not pending
        ends_in_tool_result += row["messages"][-1]["role"] == "tool"
    assert ends_in_tool_result
    calls = [c for r in with_tools for m in r["messages"] for c in m.get("tool_calls", [])]
    assert len({c["id"] for c in calls}) == len(calls)
    assert any(isinstance(c["function"]["arguments"], dict) for c in calls)
    assert any(isinstance(c["function"]["arguments"], str) for c in calls)
    assert any(m["content"] == "" for r in with_tools for m in r["messages"] if "tool_calls" in m)
    assert any("reasoning_content" in m for r in rows(out, "openai") for m in r["messages"])


def test_lengths_are_mostly_short_with_a_long_tail(tmp_path: Path) -> None:
    write_corpus(tmp_path, CorpusSpec(num_samples=3_000))
    turns = [len(m["content"]) for r in rows(tmp_path, "openai") for m in r["messages"]]
    turns += [len(t["value"]) for r in rows(tmp_path, "sharegpt") for t in r["conversations"]]
    assert max(turns) > 8_000
    lengths = [len(r["messages"][-1]["content"]) for r in rows(tmp_path, "openai") if is_prompt_only("openai", r)]
    assert 60 < statistics.median(lengths) < 400, "median prompt of ~15-100 tokens"
    assert sum(80 <= n <= 1_600 for n in lengths) / len(lengths) > 0.6, "most prompts 20-400 tokens"


def texts(fmt: str, row: dict[str, Any]) -> list[str]:
    if fmt == "openai":
        return [m["content"] for m in row["messages"]]
    if fmt == "sharegpt":
        return [t["value"] for t in row["conversations"]]
    return [row[k] for k in ("instruction", "input", "output") if k in row]


def test_text_is_clean_ascii_and_python_blocks_parse(corpus: tuple[Path, dict[str, int]]) -> None:
    out, _ = corpus
    assert all(p.read_bytes().isascii() for p in out.rglob("part-*.jsonl"))
    blocks = [b for fmt in FORMATS for r in rows(out, fmt) for t in texts(fmt, r) for b in PYTHON_BLOCK.findall(t)]
    assert len(blocks) > 100
    for block in blocks:
        ast.parse(block)


# --- counts and plan ---------------------------------------------------------------------


def test_full_scale_mix_is_exact() -> None:
    counts = category_counts(REFERENCE_SAMPLES)
    assert sum(counts.values()) == REFERENCE_SAMPLES == 913_786
    assert counts["prompt_only"] == 800_000


@pytest.mark.parametrize("n", [1, 7, 999, 10_000, 123_457, REFERENCE_SAMPLES, 2_000_000])
def test_scaling_is_proportional_and_exact(n: int) -> None:
    full, counts = category_counts(REFERENCE_SAMPLES), category_counts(n)
    assert sum(counts.values()) == n and all(v >= 0 for v in counts.values())
    for c in CATEGORIES[1:]:
        assert abs(counts[c] - full[c] * n / REFERENCE_SAMPLES) < 1, "scaled by floor; prompt-only takes the rest"
    by_format = format_counts(n)
    assert {c: sum(f.get(c, 0) for f in by_format.values()) for c in CATEGORIES} == counts
    if n == 10_000:
        assert counts["prompt_only"] / n == pytest.approx(0.875, abs=0.005)


@pytest.mark.parametrize(("n", "per_file"), [(10_000, 2_500), (913_786, 50_000), (57, 1), (1_000, 7), (3, 50_000)])
def test_plan_spreads_each_format_exactly_over_its_files(n: int, per_file: int) -> None:
    shards = plan_shards(CorpusSpec(num_samples=n, rows_per_file=per_file))
    for fmt, expected in format_counts(n).items():
        mine = [s for s in shards if s.fmt == fmt]
        assert [s.index for s in mine] == list(range(len(mine)))
        assert all(0 < sum(s.counts.values()) <= per_file and min(s.counts.values()) > 0 for s in mine)
        assert all(sum(s.counts.values()) == per_file for s in mine[:-1]), "only the last file is short"
        totals = {c: sum(s.counts.get(c, 0) for s in mine) for c in CATEGORIES}
        assert totals == {c: expected.get(c, 0) for c in CATEGORIES}


@pytest.mark.parametrize("field", ["num_samples", "rows_per_file"])
def test_spec_rejects_nonpositive_sizes_naming_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CorpusSpec(**{field: 0})


# --- determinism and re-runs -------------------------------------------------------------


def test_same_spec_gives_identical_bytes_and_other_seed_differs(
    corpus: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    out, _ = corpus
    write_corpus(tmp_path / "again", SPEC)
    assert snapshot(tmp_path / "again") == snapshot(out)
    write_corpus(tmp_path / "seed1", CorpusSpec(num_samples=SPEC.num_samples, seed=1, rows_per_file=SPEC.rows_per_file))
    other = snapshot(tmp_path / "seed1")
    assert other.keys() == snapshot(out).keys()
    assert all(other[k] != v for k, v in snapshot(out).items() if k.endswith(".jsonl"))


def test_a_shard_written_alone_equals_the_same_shard_of_the_corpus(
    corpus: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    out, _ = corpus
    shard = [s for s in plan_shards(SPEC) if s.fmt == "openai"][-1]
    write_shard(tmp_path, SPEC, shard)
    assert (tmp_path / shard.relpath).read_bytes() == (out / shard.relpath).read_bytes()


def test_rerun_skips_complete_files_and_rewrites_missing_or_truncated_ones(tmp_path: Path) -> None:
    spec = CorpusSpec(num_samples=2_000, rows_per_file=400)
    write_corpus(tmp_path, spec)
    before = snapshot(tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("part-*.jsonl")}
    assert write_corpus(tmp_path, spec) == category_counts(2_000)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("part-*.jsonl")} == stamps, "nothing rewritten"
    missing, truncated = tmp_path / "openai/part-00001.jsonl", tmp_path / "sharegpt/part-00000.jsonl"
    missing.unlink()
    truncated.write_bytes(truncated.read_bytes()[:1000])
    write_corpus(tmp_path, spec)
    assert snapshot(tmp_path) == before
    assert not list(tmp_path.rglob("*.tmp"))


def test_rerun_after_an_interrupted_run_completes_it(tmp_path: Path) -> None:
    spec = CorpusSpec(num_samples=2_000, rows_per_file=400)
    write_corpus(tmp_path / "whole", spec)
    partial = tmp_path / "partial"
    write_shard(partial, spec, plan_shards(spec)[0])  # a file with no manifest entry is rewritten
    (partial / "alpaca").mkdir()
    (partial / "alpaca/part-00000.jsonl.tmp").write_text("half a line")
    write_corpus(partial, spec)
    assert snapshot(partial) == snapshot(tmp_path / "whole")


def test_rerun_with_another_spec_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    write_corpus(tmp_path, CorpusSpec(num_samples=500))
    with pytest.raises(ValueError, match="empty output_dir"):
        write_corpus(tmp_path, CorpusSpec(num_samples=500, seed=1))


def test_the_multi_turn_mix_has_no_prompt_only_rows_and_its_conversations_run_long(tmp_path: Path) -> None:
    counts = category_counts(1_000, "multi_turn")
    assert sum(counts.values()) == 1_000 and set(counts) == {"multi_turn", "tool_calling", "agentic_coding"}
    write_corpus(tmp_path, CorpusSpec(num_samples=300, mix="multi_turn"))
    rows = [json.loads(line) for p in sorted(tmp_path.glob("*/*.jsonl")) for line in p.read_text().splitlines()]
    turns = [len(r.get("messages") or r.get("conversations")) for r in rows]
    assert len(rows) == 300 and min(turns) >= 2 and statistics.mean(turns) > 4
