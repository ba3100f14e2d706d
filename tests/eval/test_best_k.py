"""The K to serve (raypipe.eval.best_k): the table, the best K per level, the served K, and export.json's rewrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypipe.eval.best_k import best_k_report, best_per_level, choose, format_table, k_table, write_served_k
from raypipe.storage import Storage


def _row(k: int, concurrency: int, tpot: float | None, rate: float = 100.0, tau: float | None = 2.0) -> dict:
    return {
        "drafter": "trained",
        "num_speculative_tokens": k,
        "concurrency": concurrency,
        "tpot_ms": None if tpot is None else {"mean": tpot, "p50": tpot, "p90": tpot},
        "tokens_per_s": rate,
        "tau": tau,
    }


def _table(tpots: dict[int, dict[int, float | None]]) -> dict:
    return k_table([_row(k, level, t) for level, by_k in tpots.items() for k, t in by_k.items()])


def test_the_table_holds_tpot_rate_and_tau_per_level_and_k() -> None:
    rows = [_row(2, 16, 9.0, 300.0, 2.5), _row(1, 1, 5.0, 90.0, 1.9), _row(2, 1, 4.0, 110.0, 2.6)]
    table = k_table(rows)
    assert list(table) == [1, 16] and list(table[1]) == [1, 2]
    assert table[1][2] == {"tpot_ms": 4.0, "tokens_per_s": 110.0, "tau": 2.6}
    assert table[16] == {2: {"tpot_ms": 9.0, "tokens_per_s": 300.0, "tau": 2.5}}
    with pytest.raises(AssertionError, match="K=2 measured twice at concurrency 1"):
        k_table(rows + [_row(2, 1, 4.0)])


def test_the_best_k_per_level_is_the_lowest_mean_tpot() -> None:
    table = _table({1: {1: 5.0, 2: 4.0, 3: 4.5}, 16: {1: 8.0, 2: 9.0, 3: 10.0}})
    assert best_per_level(table) == {1: 2, 16: 1}


def test_a_tie_goes_to_the_smaller_k_and_a_missing_tpot_is_no_candidate() -> None:
    table = _table({1: {1: 5.0, 2: 4.0, 3: 4.0}, 4: {1: None, 2: 7.0, 3: 6.0}, 16: {1: None, 2: None, 3: None}})
    assert best_per_level(table) == {1: 2, 4: 3, 16: None}  # 16: every reply a single token, no TPOT


def test_the_served_k_has_the_lowest_worst_case_ratio_to_each_levels_best() -> None:
    # Concurrency 1 likes K=3, 16 likes K=1; K=2 loses at most 5 % anywhere, K=3 22 %, K=1 25 %.
    table = _table({1: {1: 5.0, 2: 4.2, 3: 4.0}, 16: {1: 9.0, 2: 9.45, 3: 11.0}})
    assert best_per_level(table) == {1: 3, 16: 1}
    assert choose(table) == 2
    # Where the levels agree, their common best; a tie of worst ratios goes to the smaller K.
    assert choose(_table({1: {1: 5.0, 2: 4.0, 3: 4.5}, 16: {1: 9.0, 2: 8.0, 3: 8.5}})) == 2
    assert choose(_table({1: {1: 4.0, 2: 5.0}, 16: {1: 10.0, 2: 8.0}})) == 1  # both 1.25 worst


def test_only_a_k_measured_at_every_level_with_a_best_is_served() -> None:
    # K=3 is best at 1 but has no TPOT at 16, where others have one: it cannot be vouched for there.
    assert choose(_table({1: {1: 5.0, 2: 4.5, 3: 3.0}, 16: {1: 9.0, 2: 8.0, 3: None}})) == 2
    # A level without any TPOT constrains nothing; no TPOT at all chooses nothing (block − 1 stays).
    assert choose(_table({1: {1: 5.0, 2: 4.0}, 16: {1: None, 2: None}})) == 2
    assert choose(_table({1: {1: None, 2: None}})) is None


def test_the_report_is_json_with_text_keys_and_prints_as_a_table() -> None:
    rows = [
        _row(k, level, t)
        for level, ts in {1: [5.0, 4.0, 4.5], 16: [8.0, 9.0, 10.0]}.items()
        for k, t in zip((1, 2, 3), ts)
    ]
    report = best_k_report(rows, block_size=4)
    assert json.loads(json.dumps(report)) == report
    assert report["levels"] == [1, 16] and report["ks"] == [1, 2, 3]
    assert report["best_per_level"] == {"1": 2, "16": 1}
    assert report["chosen"] == 2 and report["default"] == 3
    assert report["worst_ratio_to_best"] == pytest.approx({"1": 1.25, "2": 1.125, "3": 1.25})
    text = format_table(report)
    assert text.splitlines()[0].startswith("| K | concurrency 1: TPOT ms")
    assert "| 2 (served) | 4.00, 100, 2.00 **best** | 9.00, 100, 2.00 |" in text


def test_export_json_is_rewritten_with_the_served_k(tmp_path: Path) -> None:
    export = Storage(str(tmp_path / "drafter"), {})
    speculative = {"method": "dflash", "model": export.url, "num_speculative_tokens": 3}
    export.write_json("export.json", {"files": ["config.json"], "speculative_config": speculative, "vllm_command": "x"})
    by = {"measurement": "the K sweep", "levels": [1, 16]}
    doc = write_served_k(export, 2, by, lambda spec: f"vllm serve t --speculative-config '{json.dumps(spec)}'")
    assert doc == export.read_json("export.json")
    assert doc["speculative_config"] == {**speculative, "num_speculative_tokens": 2}
    assert doc["vllm_command"] == f"vllm serve t --speculative-config '{json.dumps(doc['speculative_config'])}'"
    assert doc["num_speculative_tokens_chosen_by"] == by and doc["files"] == ["config.json"]
    assert [p.name for p in (tmp_path / "drafter").iterdir()] == ["export.json"]  # no temporary file left


def test_the_levels_are_checked_by_the_config() -> None:
    from pydantic import ValidationError

    from raypipe.config.eval import EvalConfig

    assert (
        EvalConfig(prompts="p.jsonl").k_concurrency == [1, 16]
        and EvalConfig(prompts="p", k_concurrency=[]).k_concurrency == []
    )
    for levels, message in (([0, 16], "must be >= 1"), ([1, 1], "must differ")):
        with pytest.raises(ValidationError, match=message):
            EvalConfig(prompts="p.jsonl", k_concurrency=levels)
