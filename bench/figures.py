"""Figures generated once, quoted everywhere: each bench records its headline figures in bench/results/NAME.json, and
the tables and lists that quote them in BENCHMARKS.md and README.md are generated from those files.

    python -m bench.figures      # rewrite the generated parts of BENCHMARKS.md and README.md

A bench script ends with `record(NAME, [figure(...), ...])` (bench/ is on sys.path when it runs as a script), which
writes the figures with the commit, the date, the exact command and the machine. A document quotes them between
markers that this module fills in, so a figure is typed nowhere by hand:

    <!-- figures table -->                  every result, one row per figure (BENCHMARKS.md)
    <!-- figures list demo ci -->           the named results, one line each (README.md)
    <!-- /figures -->

tests/test_figures.py fails when a document's generated parts differ from what the results make.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = ("BENCHMARKS.md", "README.md")
BLOCK = re.compile(r"(<!-- figures (table|list(?: [\w.-]+)+) -->\n)(.*?)(<!-- /figures -->)", re.S)
MEASURED = "measured by the command"


def figure(
    label: str, value: float, unit: str = "", *, at_least: float | None = None, at_most: float | None = None
) -> dict[str, Any]:
    """One headline figure; `at_least`/`at_most` is its target, in the same unit, so whether it is met is computed,
    never typed."""
    out: dict[str, Any] = {
        "label": label,
        "value": round(value, 3) if isinstance(value, float) else value,
        "unit": unit,
    }
    if at_least is not None:
        out["at_least"] = at_least
    if at_most is not None:
        out["at_most"] = at_most
    return out


def record(name: str, figures: list[dict[str, Any]]) -> Path:
    """Write bench/results/NAME.json for the run this process made; then `python -m bench.figures` quotes it."""
    result = {
        "benchmark": name,
        "figures": figures,
        "commit": STARTED["commit"],
        "date": STARTED["date"],
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]),
        "machine": _machine(),
        "source": MEASURED,
    }
    _check(result, name)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"[figures] {path} written; `python -m bench.figures` quotes it", file=sys.stderr)
    return path


def _commit() -> str:
    """The checkout's commit, marked when tracked files differ from it (results aside): a figure names its code."""
    if not (ROOT / ".git").exists():
        return "unknown: not a git checkout"
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return head.stdout.strip() + (" with uncommitted changes" if changed.stdout.strip() else "")


# The code and the time the run started with, taken when the bench imports this module: a commit made while it runs
# is not the code it measured.
STARTED = {"commit": _commit(), "date": datetime.now().strftime("%Y-%m-%d %H:%M")}


def _machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [platform.machine(), f"{os.cpu_count()} cores", f"{memory:.0f} GiB", f"Python {platform.python_version()}"]
    if shutil.which("nvidia-smi"):
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        parts += [line for line in gpus.stdout.splitlines() if line.strip()]
    return ", ".join(parts)


def _check(result: dict[str, Any], name: str) -> None:
    keys = {"benchmark", "figures", "commit", "date", "command", "machine", "source"}
    assert set(result) == keys, f"bench/results/{name}.json: keys {sorted(result)}, expected {sorted(keys)}"
    assert result["benchmark"] == name, f"bench/results/{name}.json names benchmark {result['benchmark']!r}"
    assert result["figures"], f"bench/results/{name}.json: no figures"
    for f in result["figures"]:
        assert {"label", "value", "unit"} <= set(f) <= {"label", "value", "unit", "at_least", "at_most"}, (name, f)


def load() -> dict[str, dict[str, Any]]:
    """Every result, by benchmark name, in name order."""
    results = {}
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        _check(result, path.stem)
        results[path.stem] = result
    return results


def _number(value: float, unit: str, clock: bool = True) -> str:
    """`value` with its unit; seconds from a minute up also as minutes and seconds (`clock`), for reading."""
    text = f"{value:,}"
    if clock and unit == "s" and value >= 60:
        whole = round(value)
        return f"{text} s ({whole // 60} min {whole % 60} s)"
    return text + unit if unit in ("x", "%") else f"{text} {unit}".rstrip()


def _target(f: dict[str, Any]) -> str:
    if "at_least" in f:
        bound, met = f"≥ {_number(f['at_least'], f['unit'], clock=False)}", f["value"] >= f["at_least"]
    elif "at_most" in f:
        bound, met = f"≤ {_number(f['at_most'], f['unit'], clock=False)}", f["value"] <= f["at_most"]
    else:
        return ""
    return f"{bound}: {'met' if met else '**not met**'}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """BENCHMARKS.md's table: one row per figure; a result's commit, date and command on its first row."""
    lines = ["| benchmark | figure | value | target | commit | date | command |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for i, f in enumerate(r["figures"]):
            command = r["command"].replace("|", "\\|")  # a table cell ends at a bare pipe
            run = [f"`{name}`", r["commit"], r["date"], f"`{command}`"] if i == 0 else ["", "", "", ""]
            lines.append(
                f"| {run[0]} | {f['label']} | {_number(f['value'], f['unit'])} | {_target(f)} | "
                f"{run[1]} | {run[2]} | {run[3]} |"
            )
    lines += ["", "Where each result comes from, and the machine:", ""]
    lines += [f"- `{name}`: {r['source']}; {r['machine']}." for name, r in results.items()]
    return "\n".join(lines) + "\n"


def listing(results: dict[str, dict[str, Any]], names: list[str]) -> str:
    """The README's quotes: one line per named result, its figures, and where to read the rest."""
    lines = []
    for name in names:
        assert name in results, f"no bench/results/{name}.json for the figures it is quoted with"
        r = results[name]
        shown = "; ".join(
            f"{f['label']}: {_number(f['value'], f['unit'])}" + (f" ({_target(f)})" if _target(f) else "")
            for f in r["figures"]
        )
        lines.append(f"- {shown} (`{r['command']}`, {r['date']}, commit {r['commit']}).")
    return "\n".join(lines) + "\n"


def generate(text: str, results: dict[str, dict[str, Any]]) -> str:
    """`text` with every figures block filled in from `results`."""

    def fill(m: re.Match) -> str:
        kind, *names = m.group(2).split()
        body = table(results) if kind == "table" else listing(results, names)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> None:
    results = load()
    for name in DOCUMENTS:
        path = ROOT / name
        text = path.read_text()
        new = generate(text, results)
        assert BLOCK.search(text), f"{name} has no figures block"
        if new != text:
            path.write_text(new)
            print(f"{name}: figures updated")


if __name__ == "__main__":
    main()
