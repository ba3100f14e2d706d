"""The Grafana dashboard is current and covers exactly the metrics raypipe defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from raypipe.dashboard import PANELS, dashboard

ROOT = Path(__file__).resolve().parents[1]


def _defined_metrics() -> set[str]:
    """Names of every Ray metric in the package, as Prometheus exports them (ray_ prefix, _total for counters)."""
    names = set()
    for path in (ROOT / "raypipe").rglob("*.py"):
        for kind, name in re.findall(r'\b(Counter|counter|Gauge|Histogram)\(\s*"(raypipe_\w+)"', path.read_text()):
            suffix = {"Counter": "_total", "counter": "_total", "Gauge": "", "Histogram": "_bucket"}[kind]
            names.add(f"ray_{name}{suffix}")  # `counter`: raypipe.counters' Counter at 0 from the start
    return names


def test_the_dashboard_file_is_generated_from_the_panel_list() -> None:
    assert json.loads((ROOT / "dashboards" / "raypipe_grafana_dashboard.json").read_text()) == dashboard(), (
        "regenerate: python -m raypipe.dashboard > dashboards/raypipe_grafana_dashboard.json"
    )


def test_every_metric_has_a_panel_and_every_panel_a_metric() -> None:
    used = {m for p in PANELS for m in re.findall(r"ray_raypipe_\w+", p.expr)}
    defined = _defined_metrics()
    assert len(defined) >= 18
    assert used == defined, f"no panel: {sorted(defined - used)}; no such metric: {sorted(used - defined)}"


def test_panels_have_titles_units_and_the_shared_datasource() -> None:
    doc = dashboard()
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "run"]
    for panel in doc["panels"]:
        assert panel["datasource"] == "${datasource}" and panel["title"] and panel["targets"][0]["expr"]
