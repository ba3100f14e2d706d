"""A real Prometheus server (Debian's `prometheus` package) that scrapes a Ray cluster the way Ray documents it:
through the file-service-discovery file Ray writes in its session directory. And the Grafana dashboard's queries,
with its template variables as Grafana substitutes them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

INSTALL = "apt-get update && apt-get install -y --no-install-recommends prometheus"
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def prometheus_binary() -> str:
    """The `prometheus` command: CI (CI=true) fails without it, since .ci/run installs it; elsewhere the test skips
    with the command that installs it."""
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"prometheus is not on PATH; .ci/run installs it with: {INSTALL}")
        pytest.skip(f"prometheus is not on PATH; install it with: {INSTALL}")
    return found


class Prometheus:
    """A Prometheus on its own free port of 127.0.0.1, its storage under `root`, scraping the targets `discovery`
    lists every `scrape_s` seconds (short: a stage's processes, and their series, last a minute or two here)."""

    def __init__(self, command: str, root: Path, discovery: Path, scrape_s: int = 2) -> None:
        self.command, self.root, self.discovery, self.scrape_s = command, root, discovery, scrape_s
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": f"{self.scrape_s}s", "evaluation_interval": f"{self.scrape_s}s"},
            "scrape_configs": [
                {
                    "job_name": "ray",
                    "file_sd_configs": [{"files": [str(self.discovery)], "refresh_interval": "5s"}],
                }
            ],
        }
        (self.root / "prometheus.yml").write_text(json.dumps(config))  # YAML reads JSON
        self.process = subprocess.Popen(
            [
                self.command,
                f"--config.file={self.root / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=(self.root / "prometheus.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        self._until(lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=5).status == 200, "ready", 60)

    def api(self, path: str, **params: Any) -> Any:
        """The `data` of a Prometheus HTTP API answer (`/api/v1/{path}`); an error answer fails with its message."""
        query = urllib.parse.urlencode(params)
        try:
            body = json.loads(urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30).read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read())
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def wait_for_targets(self, timeout_s: float = 120) -> list[str]:
        """The scrape targets, once Prometheus has found them in the discovery file and every one is up."""

        def up() -> list[str]:
            targets = self.api("targets")["activeTargets"]
            return [t["scrapeUrl"] for t in targets] if targets and all(t["health"] == "up" for t in targets) else []

        return self._until(up, "scraping every target of the discovery file", timeout_s)

    def series_per_query(self, queries: list[str], start: float, end: float) -> dict[str, int]:
        """How many series each query returns over [start, end], as Grafana's time-series panels ask (a range
        query, one point per scrape)."""
        return {
            q: len(self.api("query_range", query=q, start=start, end=end, step=f"{self.scrape_s}s")["result"])
            for q in queries
        }

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def _until(self, check: Any, what: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, (self.root / "prometheus.log").read_text()[-3000:]
            try:
                got = check()
            except OSError:
                got = None
            if got:
                return got
            assert time.monotonic() < deadline, f"Prometheus not {what} after {timeout_s:.0f} s"
            time.sleep(1)


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel query of a Grafana dashboard, its template variables set as Grafana sets "All" (each variable's
    allValue); a variable the dashboard does not define fails here rather than as Prometheus' parse error."""
    all_values = {v["name"]: v["allValue"] for v in dashboard["templating"]["list"] if v.get("includeAll")}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in all_values, f"the dashboard's queries use ${name}, which it does not define"
        return all_values[name]

    return [VARIABLE.sub(value, t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]
