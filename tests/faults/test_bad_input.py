"""The data stage on the bad-input corpus: no crash, every row and file accounted for, every good row kept.

Unit tests run the shard preparer without Ray; the integration test runs the real stage (`run_prepare`)
on a real local Ray cluster over files where bad rows sit between good ones, beside unreadable files.
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raypipe.config import DataConfig
from raypipe.data.formats import Reject, normalize
from raypipe.data.pipeline import run_prepare
from raypipe.data.prepare import ShardPreparer
from raypipe.data.rejects import RAW_BYTES
from raypipe.data.render import ChatRenderer
from raypipe.data.sources import plan_chunks
from tests.faults.bad_inputs import (
    BAD_KINDS,
    MAX_LENGTH,
    MAX_ROW_BYTES,
    NEW_ROWS,
    PER_TURN,
    WEIGHT_ZERO,
    bad_files,
    bad_jsonl,
)
from tests.helpers import data_config, prepare_lines, prepare_records, qwen_spec, renderer

U = {"role": "user", "content": "Hi"}


def test_the_corpus_has_at_least_40_kinds_and_every_crash_of_the_issue():
    assert len(BAD_KINDS) >= 40
    crashes = {
        "deep_json_row",
        "deep_tool_arguments",
        "int_over_4300_digits",
        "alpaca_null_instruction",
        "sharegpt_from_list",
        "sharegpt_from_object",
        "lone_surrogate_in_content",
        "lone_surrogate_in_id",
        "huge_line",
    }
    assert crashes <= set(NEW_ROWS)


def test_every_bad_kind_gets_its_code_and_every_good_row_is_kept(tmp_path):
    expected, good = bad_jsonl(tmp_path / "in.jsonl")
    cfg = data_config(
        sources=[{"path": str(tmp_path / "in.jsonl")}],
        output=str(tmp_path / "out"),
        max_row_bytes=MAX_ROW_BYTES,
        max_length=MAX_LENGTH,
    )
    [chunk] = plan_chunks(cfg.sources, {}, 1 << 30)
    result = ShardPreparer(cfg, qwen_spec()[1]).prepare(chunk)
    got = {r["position"]: r["code"] for r in result.rejects}
    names = dict(zip(expected, BAD_KINDS))
    assert {names[p]: (code, got.get(p)) for p, code in expected.items() if got.get(p) != code} == {}
    kept = result.table.column("sample_id").to_pylist()
    assert set(good) <= set(kept)
    s = result.stats
    assert (
        s["rows_in"] == 2 * len(BAD_KINDS) + 2
        and s["rows_in"] + s["split_extra"] == s["rows_kept"] + s["rows_rejected"]
    )
    assert all(r["code"] and r["reason"] and r["stage"] for r in result.rejects)
    json.dumps(result.rejects, ensure_ascii=False).encode()  # every record is writable as UTF-8 (surrogates escaped)


def test_an_oversized_line_is_skipped_without_being_held_and_its_record_keeps_only_the_head(tmp_path):
    line = json.dumps({"messages": [{"role": "user", "content": "é" * (1 << 20)}]}).encode()
    result = prepare_lines(
        tmp_path, [line, json.dumps({"id": "after", "messages": [U]}).encode()], max_row_bytes=MAX_ROW_BYTES
    )
    [rej] = result.rejects
    assert rej["code"] == "oversized_row" and rej["raw_truncated"] and rej["raw_bytes"] == len(line) + 1
    assert len(rej["raw"].encode()) <= RAW_BYTES and rej["raw"].startswith('{"messages"')
    assert result.table.column("sample_id").to_pylist() == ["after"]


def test_a_lone_surrogate_fails_only_its_row_of_a_batched_tokenizer_call(tmp_path):
    lines = [json.dumps({"id": f"r{i}", "messages": [U]}).encode() for i in range(5)]
    lines.insert(2, b'{"id": "bad", "messages": [{"role": "user", "content": "a\\udc00"}]}')
    result = prepare_lines(tmp_path, lines, batch_rows=100)
    assert result.table.column("sample_id").to_pylist() == [f"r{i}" for i in range(5)]
    assert [(r["sample_id"], r["stage"], r["code"]) for r in result.rejects] == [("bad", "tokenize", "lone_surrogate")]


def test_weight_zero_turn_is_context_when_rendered_once(tmp_path):
    record = {**WEIGHT_ZERO, "id": "w"}
    [row] = prepare_records(tmp_path, [record], chat_template="chatml").table.to_pylist()
    tok, _ = qwen_spec("chatml")
    supervised = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert supervised == "this<|im_end|>" and "not this" in tok.decode(row["input_ids"])


def test_weight_zero_turn_gets_no_per_turn_row():
    rows = renderer().segment(normalize(WEIGHT_ZERO))
    assert [r.turn for r in rows] == [3]
    assert "".join(t for t, s in rows[0].pieces if s) == "this<|im_end|>"


def test_a_supervised_span_with_two_end_of_turn_tokens_is_rejected():
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
        "{% if m.role == 'assistant' %}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    _, spec = qwen_spec()
    chat = ChatRenderer(template, {}, "<|im_end|>", "OK.", list(spec.reserved))
    with pytest.raises(Reject) as err:
        chat.segment(normalize({"messages": [U, {"role": "assistant", "content": "Hello"}]}))
    assert err.value.code == "extra_end_of_turn"


def test_per_turn_prompt_count_is_the_tokenizer_count(tmp_path):
    """The count that drops per-turn rows before tokenizing equals tokenizing the prompt whole."""
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": "x y"}}}],
    }
    tools = [
        {
            "type": "function",
            "function": {"name": "add", "description": "adds numbers", "parameters": {"type": "object"}},
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief.  "},
        U,
        call,
        {"role": "tool", "tool_call_id": "c", "content": " 4\n"},
        {"role": "assistant", "content": "\n4"},
        {"role": "user", "content": "日本語 🙂 and  more\n\n"},
        {"role": "assistant", "content": "ok", "reasoning_content": "fine"},
    ]
    cfg = data_config(sources=[{"path": "unused"}], output="unused", max_length=1 << 20, enable_thinking=True)
    preparer = ShardPreparer(cfg, qwen_spec(thinking=True)[1])
    rows = preparer.renderer.segment(normalize({"messages": messages, "tools": tools}))
    assert len(rows) == 3 and all(r.turn is not None for r in rows)
    for seg in rows:
        prompt = "".join(t for t, _ in seg.pieces[: seg.prompt_pieces])
        assert preparer.prompt_tokens(seg, {}) == len(preparer.backend.encode(prompt, add_special_tokens=False).ids)


def test_per_turn_rows_that_fit_are_tokenized_piece_by_piece_as_before(tmp_path):
    result = prepare_records(tmp_path, [PER_TURN], max_length=4096)
    _, spec = qwen_spec()
    preparer = ShardPreparer(data_config(), spec)
    expected = []
    for seg in preparer.renderer.segment(normalize(PER_TURN)):
        expected.append(
            [i for text, _ in seg.pieces for i in preparer.backend.encode(text, add_special_tokens=False).ids]
        )
    assert [r["input_ids"] for r in result.table.to_pylist()] == expected


def test_a_long_per_turn_conversation_tokenizes_only_what_fits(tmp_path):
    """60 long exchanges under a history-rewriting template: every turn's prompt is past max_length, nothing is
    tokenized whole."""
    words = " ".join(f"w{i:05d}" for i in range(700))
    messages = [
        m for _ in range(60) for m in ({"role": "user", "content": words}, {"role": "assistant", "content": words})
    ]
    result = prepare_records(tmp_path, [{"id": "long", "messages": messages}], max_length=512)
    s = result.stats
    assert (s["rows_in"], s["split_extra"], s["rows_kept"], s["rows_rejected"]) == (1, 59, 0, 60)
    assert s["tokens_tokenized"] == 0 and s["rejects_by_code"] == {"no_loss_in_window": 60}


def test_unreadable_files_are_named_and_rows_before_the_damage_kept(tmp_path):
    info = bad_files(tmp_path / "in")
    cfg = data_config(sources=[{"path": str(tmp_path / "in" / "*")}], output=str(tmp_path / "out"), chunk_bytes=16384)
    preparer = ShardPreparer(cfg, qwen_spec()[1])
    files, kept = {}, []
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        result = preparer.prepare(chunk)
        kept += result.table.column("sample_id").to_pylist()
        for f in result.stats["files_rejected"]:
            files[Path(f["file"]).name] = f["reason"]
        assert (
            result.stats["rows_in"] + result.stats["split_extra"]
            == result.stats["rows_kept"] + result.stats["rows_rejected"]
        )
    assert sorted(files) == sorted(info["unreadable"])
    assert "EOFError" in files["truncated.jsonl.gz"] and "BadGzipFile" in files["not_gzip.jsonl.gz"]
    assert set(info["good"]) <= set(kept)
    before_cut = [k for k in kept if k.startswith("good1")]
    assert before_cut and before_cut == [f"good{1000 + i}" for i in range(len(before_cut))]


@pytest.mark.integration
def test_the_data_stage_survives_the_corpus_on_ray(ray_cluster, tmp_path, capsys):
    inputs = tmp_path / "in"
    files = bad_files(inputs)
    expected, good = bad_jsonl(inputs / "rows.jsonl")
    cfg = DataConfig.model_validate(
        {
            "sources": [{"path": str(inputs / "*"), "name": "faults"}],
            "output": str(tmp_path / "out"),
            "tokenizer": "builtin:qwen",
            "chat_template": "qwen_strict",
            "chunk_bytes": 65536,
            "max_row_bytes": MAX_ROW_BYTES,
            "max_length": MAX_LENGTH,
            "num_actors": 2,
            "cpus_per_actor": 0.5,
        }
    )
    manifest = run_prepare(cfg)
    printed = capsys.readouterr().out

    c = manifest["counts"]
    assert c["rows_in"] + c["split_extra"] == c["rows_kept"] + c["rows_rejected"]
    records = [
        json.loads(line)
        for p in sorted((tmp_path / "out/rejects").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    rows = [r for r in records if r.get("level") != "file"]
    assert len(rows) == c["rows_rejected"] and all(r["code"] and r["reason"] and r["stage"] for r in records)

    got = {r["position"]: r["code"] for r in rows if r["file"].endswith("rows.jsonl")}
    names = dict(zip(expected, BAD_KINDS))
    assert {names[p]: (code, got.get(p)) for p, code in expected.items() if got.get(p) != code} == {}

    unreadable = [r for r in records if r.get("level") == "file"]
    assert (
        sorted(Path(r["file"]).name for r in unreadable)
        == sorted(files["unreadable"])
        == sorted(Path(f["file"]).name for f in manifest["files_rejected"])
    )
    assert all(r["code"] == "unreadable_file" for r in unreadable) and c["files_rejected"] == 4
    assert [Path(f).name for f in manifest["files_unmatched"]] == files["unmatched"] and c["files_unmatched"] == 3
    assert all(name in printed for name in files["unmatched"])

    table = pq.read_table(tmp_path / "out/data")
    kept = table.column("sample_id").to_pylist()
    assert len(kept) == c["rows_kept"] == len(set(kept))
    assert set(good) | set(files["good"]) | {"turns#1", "weight0#3"} <= set(kept)
    assert "turns#3" not in kept and "weight0#1" not in kept
    assert any(k.startswith("good1") for k in kept)  # rows of the truncated gzip before the cut
    assert sum(1 for s in manifest["shards"] if s["rows"]) > 4

    tok, _ = qwen_spec()
    [row] = [r for r in table.to_pylist() if r["sample_id"] == "weight0#3"]
    assert tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]) == "this<|im_end|>"
