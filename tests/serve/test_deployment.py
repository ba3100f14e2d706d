"""The service as a real Ray Serve deployment on a local cluster."""

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray import serve

from raypipe.serve.deployment import HiddenStateService, engine_process_options
from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.transport import StateFile, as_tensor, process_identity
from tests.helpers import scrape_metrics, serve_config

pytestmark = pytest.mark.integration
LAYERS = [1, 2, 4]


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_target):
    app = HiddenStateService.options(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64).bind(
        serve_config(tiny_target, engine="transformers", layer_ids=LAYERS)
    )
    handle = serve.run(app, name="hidden_states", route_prefix=None)
    yield handle
    serve.delete("hidden_states")


def test_states_through_serve_equal_the_engine_on_both_paths(service, tiny_target, ray_cluster):
    """From this node the states come as files this process owns; a caller elsewhere gets arrays. No tensor is
    pickled."""
    reference = TransformersEngine(tiny_target, tuple(LAYERS))
    where = {"node_id": ray.get_runtime_context().get_node_id(), "owner": process_identity()}
    batches = [[list(range(100 + i, 120 + 3 * i))] for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        here = list(pool.map(lambda b: service.extract.remote(b, **where).result(), batches))
        elsewhere = list(
            pool.map(lambda b: service.extract.remote(b, node_id="another-node", owner="1.1.1").result(), batches)
        )
    for batch, local, remote in zip(batches, here, elsewhere):
        [expected] = reference.extract(batch)
        assert isinstance(local[0], StateFile) and isinstance(remote[0], np.ndarray)
        for got in (as_tensor(local[0]), as_tensor(remote[0])):
            assert got.dtype == torch.float32 and got.shape == (len(batch[0]), len(LAYERS), 64)
            torch.testing.assert_close(got, expected)  # the engine's dtype end to end: fp32 here
    stats = service.stats.remote().result()
    assert not [
        p for p in Path(stats["directory"]).rglob("*.safetensors")
    ]  # every handed-over file was read and removed
    assert stats["canary"].startswith("canary ok")
    names = [
        "ray_raypipe_serve_requests_total",
        "ray_raypipe_serve_tokens_total",
        "ray_raypipe_serve_latency_s_bucket",
        "ray_raypipe_serve_canary_ok",
    ]
    metrics = scrape_metrics(ray_cluster, names)
    assert all(metrics.values()), f"not exported: {[n for n, v in metrics.items() if not v]}"


@pytest.mark.parametrize(
    "batch, problem",
    [
        ([[1, 200_000]], "outside the vocabulary"),
        ([], "non-empty"),
        ([list(range(300))], "takes at most 255"),
        ([list(range(256))], "takes at most 255"),  # max_model_len tokens leave vLLM no room for one more
        ([[1.5]], "must be an int"),
        ([[1]] * 9, "9 sequences"),
    ],
)
def test_bad_requests_are_refused_and_the_replica_stays_healthy(service, batch, problem):
    with pytest.raises(Exception, match=problem):
        service.extract.remote(batch).result()
    assert len(service.extract.remote([[1, 2, 3]]).result()[0]) == 3


def test_vllm_engine_in_a_serve_replica_passes_the_canary_and_serves_reference_states(ray_cluster, tiny_target):
    cfg = serve_config(tiny_target, layer_ids=LAYERS)
    app = HiddenStateService.options(ray_actor_options=engine_process_options(cfg)).bind(cfg)
    handle = serve.run(app, name="hidden_states_vllm", route_prefix=None)
    try:
        assert handle.stats.remote().result()["canary"].startswith("canary ok")
        batch = [list(range(300, 340)), [9707, 1879]]
        got = handle.extract.remote(batch).result()
        for g, r in zip(got, TransformersEngine(tiny_target, tuple(LAYERS)).extract(batch)):
            torch.testing.assert_close(as_tensor(g), r, rtol=1e-4, atol=1e-5)
        assert handle.canary.remote().result().startswith("canary ok")
        reply = handle.generate.remote([[9707, 1879]], {"max_tokens": 5}).result()
        assert reply == TransformersEngine(tiny_target, (4,)).generate([[9707, 1879]], Sampling(max_tokens=5))

        # Requests stream through the engine side by side, and the health check never waits behind them.
        long = handle.generate.remote([[9707, 1879]] * 4, {"max_tokens": 300})._to_object_ref_sync()
        many = [handle.extract.remote([list(range(400 + 7 * i, 460 + 7 * i))]) for i in range(8)]
        handle.check_health.remote().result()
        assert ray.wait([long], timeout=0)[1] == [long], "the health check returned only after the long generation"
        assert all(len(r.result()[0]) == 60 for r in many) and len(ray.get(long)) == 4
        assert handle.stats.remote().result()["max_in_flight"] > 1
    finally:
        serve.delete("hidden_states_vllm")


def test_the_serve_job_answers_health_and_stats_over_http_on_loopback(tmp_path):
    """`jobs/serve_target.py` as a user runs it: the debug recipe with the reference engine, HTTP on 127.0.0.1."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from tests.helpers import free_port

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    cmd = [
        sys.executable,
        "jobs/serve_target.py",
        "--recipe",
        "debug_cpu",
        "serve.engine=transformers",
        "serve.dtype=float32",
        f"serve.http_port={port}",
    ]
    env = {**os.environ, "RAY_ADDRESS": "local", "RAYPIPE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline, health = time.monotonic() + 240, None
        while time.monotonic() < deadline and health is None:
            assert proc.poll() is None, "the serve job exited"
            try:
                health = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/hidden_states/health", timeout=5).read().decode()
                )
            except OSError:
                time.sleep(2)
        assert health == '"ok"'
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/hidden_states/stats", timeout=5).read())
        assert stats["layer_ids"] == [1, 4] and stats["canary"].startswith("canary ok")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
