"""Shared fixtures (a real local Ray cluster, a real S3 API on loopback, the built targets, a private asset cache)
and the collection hooks that split the suite into streams; plain helpers are in tests/helpers.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # one auth mode for the test cluster and its clients
# One torch thread per process (Ray's workers get one already): the suite runs two streams of tests on 2 cores, and
# two OpenMP threads that must meet at every operation while the other stream holds a core wait for each other
# (measured: the demo target's build ran 2.0x slower with 2 threads than with 1 beside a busy process, 1.25x
# faster alone). Set before torch is imported; the processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray starts its workers at nice 15, below the pytest processes: on 2 cores the stream on the session's cluster then
# stalled while the other streams' in-process work ran (a data-stage test: 35 s alone, 136 s in CI), and finished
# last, alone, with a core idle. At nice 0 the streams share the cores evenly. The test clusters inherit it.
os.environ.setdefault("RAY_worker_niceness", "0")

from tests.helpers import free_port  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 3 --dist loadgroup`, pyproject's default) the integration tests run in two streams,
    one per worker, each test of a stream after the other, and the unit tests on the third worker beside them:
    - "cluster": the tests on the session's Ray cluster (`ray_cluster`: one cluster per process, so one stream);
    - "apart": the others, which start their own clusters, servers, engines or the demo target's build.
    One stream alone leaves a core idle for much of its time (waiting on an autoscaler, a deploy, a single-threaded
    build). Two streams with the unit tests after them took 1,587 s; the unit tests beside them, 1,502 s. Four
    streams kept the cores busy (6% idle) but ran the machine short of memory (20.6 of 23 GiB used, an engine refused):
    docs/benchmarks_log.md, issue 14."""
    for item in items:
        if "ray_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif item.get_closest_marker("integration") or "demo_target" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("apart"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """pytest-xdist groups by renaming node ids; a pytest that ignores the rename (9.2 does) must not pass unseen."""
    if getattr(session.config.option, "loadgroup", False):
        grouped = [i for i in session.items if i.get_closest_marker("xdist_group")]
        assert all("@" in i.nodeid for i in grouped), "pytest-xdist's groups were ignored"


@pytest.fixture
def memory_heavy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One at a time, across the xdist streams: the runs that hold a τ engine beside a service and trainers (the demo
    job, the τ tests). Two of them at once, with the demo's evaluation engines, took the 24 GiB machine past Ray's
    memory threshold (its monitor killed the job's actors: CI of issue 39)."""
    import fcntl

    lock = tmp_path_factory.getbasetemp().parent / "raypipe-memory-heavy.lock"  # shared by the xdist workers
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session", autouse=True)
def raypipe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep tests off the user's ~/.cache/raypipe, so they exercise the cold builds too (Ray workers inherit it)."""
    root = tmp_path_factory.mktemp("raypipe_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYPIPE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def demo_target(raypipe_cache: Path) -> str:
    """The demo target, trained once per session where `builtin:demo` resolves (about 3 minutes on 2 cores)."""
    from raypipe.target import resolve_model

    return resolve_model("builtin:demo")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A real local Ray cluster; yields the URL of its Prometheus metrics endpoint."""
    import ray

    port = free_port()
    ray.init(
        address="local", num_cpus=4, logging_level="WARNING", include_dashboard=True, _metrics_export_port=port
    )  # Ray Train checks its controller through the state API
    yield f"http://127.0.0.1:{port}/metrics"
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """A real S3 API (moto in server mode) on 127.0.0.1; yields fsspec storage options."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    ).create_bucket(Bucket="raypipe")
    yield {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    server.stop()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 target, built in code once per test session."""
    from raypipe.assets.tiny_target import build_tiny_target

    return str(build_tiny_target(tmp_path_factory.mktemp("models") / "tiny_target"))
