"""The autoscaler grows a head-only cluster for the prepare and train jobs and shrinks it after; the service scales
on backlog.

The fake node types mirror those of each cluster layout (same names and
custom resources, this machine's size): cluster.yaml's one GPU node type
that carries both the service and the trainer, and cluster_separate.yaml's
serve and train node types; placement follows the same rules as on AWS. The job
runs in this checkout rather than an uploaded working dir: fake nodes share
one disk, and a removed node's runtime-env agent deleted the uploaded package
under the running driver (its working directory vanished mid-job);
tests/test_jobs.py covers `--working-dir` on a real head node, and the
evaluation stage (whose engines take the service's resources, already
scaled here).
"""

from __future__ import annotations

import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
# Per layout: each worker node type at this machine's size (no GPUs here: the custom resources do the placing), and
# the node type whose count shows the service's second replica (one serve_gpu unit per node, so a replica per node).
FAKE = {
    "cluster.yaml": ({"cpu": {"CPU": 2}, "gpu": {"CPU": 2, "serve_gpu": 1, "train_gpu": 2}}, "gpu"),
    "cluster_separate.yaml": (
        {"cpu": {"CPU": 2}, "serve_gpu": {"CPU": 1, "serve_gpu": 1}, "train_gpu": {"CPU": 1, "train_gpu": 2}},
        "serve_gpu",
    ),
}


def fake_node_types(layout: str) -> dict:
    cluster = yaml.safe_load((ROOT / layout).read_text())
    types = {n: t for n, t in cluster["available_node_types"].items() if n != cluster["head_node_type"]}
    resources, _ = FAKE[layout]
    assert set(types) == set(resources)
    return {
        n: {"resources": resources[n], "node_config": {}, "min_workers": t["min_workers"], "max_workers": 2}
        for n, t in types.items()
    }


class NodeWatcher(threading.Thread):
    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.peak, self.stopping = cluster, Counter(), threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(2):
            try:
                now = Counter(self.cluster.node_types_alive())
            except Exception:  # noqa: BLE001 - the GCS may be busy for a moment on 2 cores
                continue
            self.peak |= now


@pytest.fixture(params=sorted(FAKE))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fake_cluster(layout: str, tmp_path: Path) -> LocalCluster:
    cluster = LocalCluster(
        tmp_path / "cluster", head_cpus=0, node_types=fake_node_types(layout), idle_timeout_minutes=0.5
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.timeout(1800)  # the jobs, then the idle timeout; slower when the suite shares the 2 cores
def test_prepare_and_train_scale_the_node_types_up_and_back_down(
    layout: str, fake_cluster: LocalCluster, demo_target: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    overrides = [
        "name=autoscaled",
        "data.sources=[{path: data/demo/heldout.jsonl}]",
        f"data.output={out}/prepared",
        "data.num_actors=1",
        "data.cpus_per_actor=1",
        "serve.resource=serve_gpu",
        "serve.max_replicas=2",
        "serve.target_ongoing_requests=1",
        "serve.upscale_delay_s=2",
        f"train.output={out}/train",
        "train.run.resource=train_gpu",
        "train.schedule.epochs=2",
        "train.drafter.draft_layers=1",  # CI's time: the scaling is under test, not the drafter
        "train.states.mode=online",
        "train.states.cache=null",
        f"serve.http_port={free_port()}",  # the session's Ray cluster may hold Serve's default port
    ]
    assert fake_cluster.node_types_alive() == []  # head only
    watcher = NodeWatcher(fake_cluster)
    watcher.start()
    jobs = " && ".join(
        shlex.join([sys.executable, job, "--recipe", "demo", *overrides])
        for job in ("jobs/prepare_data.py", "jobs/train_drafter.py")
    )
    status, logs = fake_cluster.wait(fake_cluster.submit(["bash", "-c", f"cd {ROOT} && {jobs}"], None), timeout_s=1500)
    assert status == "SUCCEEDED", logs[-5000:]
    _, second_replica_node = FAKE[layout]
    assert watcher.peak["cpu"] >= 1 and all(watcher.peak[n] >= 1 for n in FAKE[layout][0]), watcher.peak
    assert watcher.peak[second_replica_node] == 2, (
        f"the service did not scale to its second replica on backlog: {watcher.peak}"
    )

    deadline = time.monotonic() + 240
    while fake_cluster.node_types_alive() and time.monotonic() < deadline:
        time.sleep(3)
    watcher.stopping.set()
    assert fake_cluster.node_types_alive() == [], "idle nodes were not removed after the idle timeout"
