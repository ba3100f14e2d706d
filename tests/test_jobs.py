"""The README's way to run raypipe: `ray start --head` with Ray's token auth on, then `ray job submit` the pipeline on
the demo recipe with `RAY_AUTH_MODE=token` and the token.

One run checks the job (success, resume by stage), the outputs (rejects,
stage records, the export), the evaluation (τ in vLLM, the estimates beside
it, the plots) and the metrics of every stage on the cluster's endpoint.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raypipe.layout import RunFolders
from raypipe.storage import Storage
from raypipe.train.ledger import read_training_curve
from tests.helpers import free_port
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
STAGE_METRICS = {
    "data": ["ray_raypipe_data_rows_total", "ray_raypipe_data_tokens_total", "ray_raypipe_data_rejects_total"],
    "serve": ["ray_raypipe_serve_latency_s_bucket", "ray_raypipe_serve_requests_total"],
    "train": ["ray_raypipe_train_wait_fraction", "ray_raypipe_train_loss", "ray_raypipe_train_tau_estimate"],
    "eval": ["ray_raypipe_eval_tau"],
}


def check_demo_evaluation(doc: dict) -> None:
    """The demo's drafter is really accepted in vLLM, and the estimates agree with vLLM (issue 5's must-show)."""
    print(json.dumps({k: doc[k] for k in ("tau", "comparisons", "vllm_untrained_drafter")}, indent=1))
    greedy = doc["vllm"][0]
    # 1 layer and 2 epochs here (with 6, τ 2.89; with 2, 2.49: BENCHMARKS.md)
    assert greedy["temperature"] == 0.0 and doc["tau"] == greedy["tau"] >= 2.0
    assert doc["num_speculative_tokens"] == 3 and len(greedy["accepted_per_position"]) == 3
    assert doc["vllm_untrained_drafter"]["tau"] < 1.2  # the same prompts with an untrained drafter: about 1
    assert doc["greedy_replies_match_without_drafter"]  # speculative decoding stays lossless
    assert not doc["disagreement"], doc["comparisons"]  # the replays agree with vLLM at every temperature
    assert doc["offline_replay"]["steps"] == greedy["drafts"]  # the replay walks vLLM's own verification steps
    # At temperature 1 too: vLLM's rejection sampling, replayed on the tokens it sampled, once the CPU build's
    # sampler is fixed (raypipe.compat.vllm_cpu_fixes; before, τ at temperature 1 fell to about 1.3).
    [sampled] = [g for g in doc["vllm"] if g["temperature"] == 1.0]
    assert doc["offline_replay_sampled"][0]["steps"] == sampled["drafts"], doc["offline_replay_sampled"]
    assert len(doc["vllm_cpu_fixes"]) == 2
    assert all(g["tokens_per_s"] > 0 for g in doc["vllm_without_drafter"])
    # τ per category of the held-out prompts (each demo prompt names its task), weighted back to the whole.
    categories = greedy["categories"]
    assert set(doc["tau_by_category"]) == set(categories) == set(doc["prompts"]["categories"]) and len(categories) > 3
    assert sum(c["drafts"] for c in categories.values()) == greedy["drafts"]
    # The latency sweep through vLLM's OpenAI server: with the drafter and without, at each level.
    rows = doc["latency"]["rows"]
    assert [(r["drafter"], r["concurrency"]) for r in rows] == [("trained", 1), ("trained", 4), ("no", 1), ("no", 4)]
    assert all(r["requests"] == 8 and r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["mean"] > 0 for r in rows)
    assert all(r["tau"] > 1.5 for r in rows[:2]) and all(r["tau"] is None for r in rows[2:])
    assert [s["concurrency"] for s in doc["latency"]["speedup"]] == [1, 4]
    assert [Path(p).name for p in doc["plots"]] == ["acceptance.png", "latency.png", "training.png"]
    for plot in doc["plots"]:
        pixels = np.asarray(Image.open(plot).convert("L"))
        assert pixels.shape[0] > 300 and (pixels < 200).mean() > 0.01  # a drawn figure, not an empty canvas


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


def refused_without_token(dashboard_url: str) -> bool:
    """The job API answers 401 to a request that carries no token."""
    try:
        urllib.request.urlopen(f"{dashboard_url}/api/jobs/", timeout=30)
    except urllib.error.HTTPError as err:
        return err.code == 401
    return False


@pytest.fixture
def head(tmp_path: Path) -> LocalCluster:
    """A head with token auth on, as the README starts one. The token is a file, as `ray get-auth-token --generate`
    writes it; the head and `ray job submit` read it through RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE=token."""
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    cluster = LocalCluster(
        tmp_path / "cluster", head_cpus=4, auth={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.timeout(1800)  # the demo pipeline twice (run, then resume); slower when the suite shares the 2 cores
def test_the_submitted_pipeline_job_succeeds_resumes_and_reports_every_stage(
    head: LocalCluster, demo_target: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    job = [
        sys.executable,
        "jobs/pipeline.py",
        "--recipe",
        "demo",
        f"data.output={out}/prepared",
        f"train.output={out}/train",
        f"train.states.cache={out}/cache",
        f"serve.http_port={free_port()}",  # the session's Ray cluster may hold Serve's default port
        "train.schedule.epochs=2",  # CI's time; the recipe's 6 epochs and 3 layers are measured in BENCHMARKS.md
        "train.drafter.draft_layers=1",
        "eval.concurrency=[1,4]",
        "eval.latency_prompts=8",
    ]
    watcher = MetricsWatcher(head.metrics_url)
    watcher.start()
    status, logs = head.wait(head.submit(job, ROOT), timeout_s=1800)
    watcher.stopping.set()
    assert status == "SUCCEEDED", logs[-5000:]
    assert refused_without_token(head.dashboard_url)  # the job ran on a head with token auth on
    assert "[pipeline] demo: τ" in logs and "eval.json" in logs

    # Outputs: rejects explained, every stage recorded, the drafter accepted in vLLM.
    manifest = json.loads((out / "prepared" / "manifest.json").read_text())
    assert manifest["counts"]["rows_rejected"] == 3 and sum(manifest["rejects_by_code"].values()) == 3
    assert sorted(p.stem for p in (out / "train" / "pipeline").glob("*.json")) == ["eval", "export", "prepare", "train"]
    assert (out / "train" / "drafter" / "export.json").is_file()
    check_demo_evaluation(json.loads((out / "train" / "eval" / "eval.json").read_text()))
    # The service and the trainers share this node: states came as files (epoch 1), then from the cache, none via Ray.
    curve = read_training_curve(RunFolders(Storage(str(out / "train"), {}), "demo").ledger)
    came = {k: sum(s[k] for s in curve) for k in ("states_file", "states_array", "states_cache")}
    assert came["states_file"] > 0 and came["states_cache"] > 0 and came["states_array"] == 0, came

    # Metrics of every stage went through the cluster's metrics endpoint.
    missing = {stage: [m for m in names if m not in watcher.seen] for stage, names in STAGE_METRICS.items()}
    assert not any(missing.values()), f"not scraped: {missing}"

    # A re-submitted job skips every finished stage.
    status, logs = head.wait(head.submit(job, ROOT), timeout_s=600)
    assert status == "SUCCEEDED", logs[-5000:]
    assert logs.count("done earlier with this config, skipped") == 4
