"""The README's way to run raypipe: `ray start --head`, then `ray job submit` the pipeline; metrics from every stage."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
STAGE_METRICS = {
    "data": ["ray_raypipe_data_rows_total", "ray_raypipe_data_tokens_total", "ray_raypipe_data_rejects_total"],
    "serve": ["ray_raypipe_serve_latency_s_bucket", "ray_raypipe_serve_requests_total"],
    "train": ["ray_raypipe_train_wait_fraction", "ray_raypipe_train_loss", "ray_raypipe_train_tau_estimate"],
    "eval": ["ray_raypipe_eval_tau"],
}


class MetricsWatcher(threading.Thread):
    """Scrapes the metrics endpoint while the job runs: a stage's processes (and their metrics) end with the stage."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.seen, self.stopping = url, set(), threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(3):
            try:
                body = urllib.request.urlopen(self.url, timeout=10).read().decode()
            except OSError:
                continue
            self.seen |= {line.split("{")[0] for line in body.splitlines() if line.startswith("ray_raypipe_")}


@pytest.fixture
def head(tmp_path: Path) -> LocalCluster:
    cluster = LocalCluster(tmp_path / "cluster", head_cpus=4)
    cluster.start()
    yield cluster
    cluster.stop()


def test_the_submitted_pipeline_job_succeeds_resumes_and_reports_every_stage(head: LocalCluster, demo_target: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = f"--recipe demo data.output={out}/prepared train.output={out}/train train.cache={out}/cache"
    watcher = MetricsWatcher(head.metrics_url)
    watcher.start()
    status, logs = head.wait(head.submit(f"{sys.executable} jobs/pipeline.py {args}", ROOT), timeout_s=1800)
    watcher.stopping.set()
    assert status == "SUCCEEDED", logs[-5000:]
    assert "[pipeline] demo: τ" in logs and "eval.json" in logs

    # Outputs: rejects explained, every stage recorded, the drafter accepted in vLLM.
    manifest = json.loads((out / "prepared" / "manifest.json").read_text())
    assert manifest["counts"]["rows_rejected"] == 3 and sum(manifest["rejects_by_code"].values()) == 3
    assert sorted(p.stem for p in (out / "train" / "pipeline").glob("*.json")) == ["eval", "export", "prepare", "train"]
    doc = json.loads((out / "train" / "eval" / "eval.json").read_text())
    assert doc["tau"] >= 2.5 and not doc["disagreement"], doc["comparisons"]
    assert doc["vllm_untrained_drafter"]["tau"] < 1.2 and doc["greedy_replies_match_without_drafter"]
    assert (out / "train" / "drafter" / "export.json").is_file() and all(Path(p).is_file() for p in doc["plots"])

    # Metrics of every stage went through the cluster's metrics endpoint.
    missing = {stage: [m for m in names if m not in watcher.seen] for stage, names in STAGE_METRICS.items()}
    assert not any(missing.values()), f"not scraped: {missing}"

    # A re-submitted job skips every finished stage.
    status, logs = head.wait(head.submit(f"{sys.executable} jobs/pipeline.py {args}", ROOT), timeout_s=600)
    assert status == "SUCCEEDED", logs[-5000:]
    assert logs.count("done earlier with this config, skipped") == 4
