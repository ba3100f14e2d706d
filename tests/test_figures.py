"""The figures BENCHMARKS.md and the README quote are the ones bench/results/*.json hold, and every bench records its
own (bench/figures.py)."""

import json
import re
import sys
from pathlib import Path

import pytest

from bench import figures
from bench.figures import DOCUMENTS, ROOT, figure, generate, load


def test_benchmarks_and_readme_quote_the_recorded_figures() -> None:
    results = load()
    for name in DOCUMENTS:
        text = (ROOT / name).read_text()
        assert figures.BLOCK.search(text), f"{name} has no figures block"
        assert generate(text, results) == text, f"{name} quotes stale figures: run `python -m bench.figures`"


def test_every_result_is_in_the_benchmarks_table() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "<!-- figures table -->" in text
    missing = [name for name in load() if f"| `{name}` |" not in text]
    assert not missing, missing


def test_every_bench_script_records_its_figures() -> None:
    scripts = [p for p in sorted((ROOT / "bench").glob("*.py")) if p.name != "figures.py"]
    assert scripts
    silent = [p.name for p in scripts if not re.search(r"\brecord\(\s*\n?\s*(\"\w+\"|args\.recipe)", p.read_text())]
    assert not silent, f"these bench scripts write no bench/results/NAME.json: {silent}"


def test_a_recorded_run_is_quoted_with_its_command_commit_and_whether_it_met_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "probe.py"), "--rows", "10"])
    figures.record("probe", [figure("ratio", 0.8766, "x", at_least=0.9), figure("wall", 125.0, "s", at_most=600)])
    result = json.loads((tmp_path / "probe.json").read_text())
    assert result["command"] == "python bench/probe.py --rows 10"
    assert result["source"] == figures.MEASURED
    assert re.fullmatch(r"[0-9a-f]{7}( with uncommitted changes)?", result["commit"]), result["commit"]
    assert result["figures"][0]["value"] == 0.877  # rounded once, where it is recorded

    text = "intro\n<!-- figures list probe -->\nstale\n<!-- /figures -->\nend\n"
    quoted = generate(text, load())
    assert quoted.startswith("intro\n<!-- figures list probe -->\n- ratio: 0.877x (≥ 0.9x: **not met**); ")
    assert "wall: 125.0 s (2 min 5 s) (≤ 600 s: met)" in quoted
    assert f"(`python bench/probe.py --rows 10`, {result['date']}, commit {result['commit']})." in quoted
    assert quoted.endswith("<!-- /figures -->\nend\n")
    assert generate(quoted, load()) == quoted

    with pytest.raises(AssertionError, match="no bench/results/absent.json"):
        generate("<!-- figures list absent -->\n<!-- /figures -->", load())
