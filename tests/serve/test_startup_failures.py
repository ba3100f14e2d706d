"""An engine that cannot start stops the run at once, with vLLM's own error and the setting that fixes it.

On a small node (tests/small_node.py: a real cgroup memory limit, which vLLM's
CPU backend reads as its node's size) the real vLLM engine starts with a KV
cache sized to fit; a KV cache the node cannot hold is refused by raypipe's
check before any engine starts, and, past that check, by vLLM itself, whose
error the engine's start quotes. Through Serve, the first replica that cannot
start fails the deployment with that error instead of being retried.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray import serve

from raypipe.serve.deployment import APP_NAME, deploy
from raypipe.serve.vllm_args import ENGINE_ENV
from raypipe.serve.vllm_engine import start_error
from tests.helpers import serve_config
from tests.small_node import small_node, unavailable

ROOT = Path(__file__).resolve().parents[2]
NODE_GIB = 5
ENGINE = """
import asyncio, shutil, sys
from raypipe.node_memory import check_engine_memory, engine_node, node_memory
from raypipe.serve.transport import replica_dir
from raypipe.serve.vllm_engine import VllmEngine
from raypipe.target import resolve_target
from tests.helpers import serve_config


async def main(model: str, kv_cache_gib: float, check: bool) -> None:
    cfg = serve_config(model, kv_cache_gib=kv_cache_gib)
    print("raypipe reads", node_memory(engine_node()).describe(), flush=True)
    if check:
        check_engine_memory(cfg, 1)
    directory = replica_dir()
    engine = VllmEngine(resolve_target(cfg), cfg, directory)
    try:
        await engine.extract(list(range(100, 160)))
        print("served", flush=True)
    finally:
        engine.close()
        shutil.rmtree(directory)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3] == "check"))
"""


def on_small_node(tmp_path: Path, model: str, kv_cache_gib: float, check: bool) -> tuple[int, str]:
    """(exit status, output) of the engine script on a NODE_GIB node; its output goes to a file, as a Ray worker's."""
    script, log = tmp_path / "engine.py", tmp_path / "engine.log"
    script.write_text(ENGINE)
    with small_node(NODE_GIB) as prefix, log.open("w") as out:
        command = [*prefix, sys.executable, str(script), model, str(kv_cache_gib), "check" if check else "start"]
        status = subprocess.run(
            command, cwd=ROOT, env={**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out
        )
    return status.returncode, log.read_text()


small = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
# What vLLM's processes printed when the KV cache did not fit (the engine core's traceback, shortened)
LOGGED = """\
(Worker pid=9012) INFO 12-01 10:57:04 [cpu_worker.py:96] Loading weights took 0.29 seconds
(Worker pid=9012) ERROR 12-01 10:57:05 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=9012) ERROR 12-01 10:57:05 [multiproc_executor.py:1063] ValueError: Available memory on node 0 \
(5.61/13.84 GiB) on kv cache allocation is less than requested memory for kv (50.0 GiB). Decrease \
--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.
(EngineCore pid=8199) ERROR 12-01 10:57:05 [core.py:1510] EngineCore failed to start.
(EngineCore pid=8199) ERROR 12-01 10:57:05 [core.py:1510] RuntimeError: Worker failed with error 'Available memory \
on node 0 (5.61/13.84 GiB) ...', please check the stack trace above for the root cause
"""
RAISED = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")


def test_the_start_error_is_vllms_root_cause_with_the_setting(tmp_path):
    log = tmp_path / "worker.out"
    log.write_text("an earlier engine's lines: ERROR 12-01 10:00:00 [core.py:1] OSError: not this one\n")
    since = {str(log): log.stat().st_size}
    with log.open("a") as out:
        out.write(LOGGED)
    assert str(start_error(RAISED, since)) == (
        "vLLM did not start: ValueError: Available memory on node 0 (5.61/13.84 GiB) on kv cache allocation is less "
        "than requested memory for kv (50.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce "
        "CPU memory used by other processes. Fix: lower serve.kv_cache_gib (each engine's KV cache), run fewer "
        "engines at once (serve.max_replicas), or free memory on the node"
    )
    raised_here = ValueError("User-specified max_model_len (9000) is greater than the derived max_model_len (512)")
    assert str(start_error(raised_here, {})) == (
        "vLLM did not start: ValueError: User-specified max_model_len (9000) is greater than the derived "
        "max_model_len (512) Fix: lower serve.max_model_len to the target's context length"
    )
    assert str(start_error(RAISED, {})) == f"vLLM did not start: RuntimeError: {RAISED}"  # no output to read


@pytest.mark.integration
@small
def test_an_engine_on_a_small_node_starts_with_a_kv_cache_that_fits(tmp_path, tiny_target):
    status, out = on_small_node(tmp_path, tiny_target, 0.25, check=True)
    assert status == 0, out[-3000:]
    assert "raypipe reads NUMA node 0: " in out and f"of {NODE_GIB}.00 GiB available" in out
    assert f"Explicitly set (0.25/{NODE_GIB}.0) GiB for KV cache on node 0" in out  # vLLM sees the small node
    assert "served" in out


@pytest.mark.integration
@small
def test_a_kv_cache_the_small_node_cannot_hold_is_refused_before_any_engine_starts(tmp_path, tiny_target):
    status, out = on_small_node(tmp_path, tiny_target, 4, check=True)
    assert status != 0
    assert "ValueError: serve.kv_cache_gib: 1 vLLM engine(s) need 6.5" in out
    assert "GiB available (vLLM sizes its CPU engines from it)" in out and "Fix: set serve.kv_cache_gib=" in out
    assert "EngineCore" not in out  # no engine was started


@pytest.mark.integration
@small
def test_vllm_refusing_a_kv_cache_on_a_small_node_is_quoted_with_the_setting(tmp_path, tiny_target):
    """Past raypipe's check, vLLM's own refusal (logged by its worker process) is what the start raises."""
    status, out = on_small_node(tmp_path, tiny_target, 4, check=False)
    assert status != 0
    [error] = [line for line in out.splitlines() if line.startswith("raypipe.serve.vllm_engine.EngineStartError")]
    assert "vLLM did not start: ValueError: Available memory on node 0 (" in error
    assert f"/{NODE_GIB}.0 GiB) on kv cache allocation is less than requested memory for kv (4.0 GiB)" in error
    assert "Fix: lower serve.kv_cache_gib" in error


@pytest.mark.integration
def test_a_replica_whose_engine_cannot_start_fails_the_deploy_with_vllms_error(ray_cluster, tiny_target):
    """No retries: the first replica's failure deletes the application and raises vLLM's error with the setting."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        deploy(serve_config(tiny_target, kv_cache_gib=4096))  # past the memory check run_service makes first
    print(f"deploy failed after {time.monotonic() - start:.0f} s: {failed.value}", flush=True)
    message = str(failed.value)
    assert message.startswith("the hidden-state service did not start: ")
    assert "EngineStartError: vLLM did not start: ValueError: Available memory on node 0 (" in message
    assert "less than requested memory for kv (4096.0 GiB)" in message and "Fix: lower serve.kv_cache_gib" in message
    assert APP_NAME not in serve.status().applications


@pytest.mark.integration
def test_a_replica_whose_node_cannot_hold_the_state_files_fails_the_deploy_before_its_engine(ray_cluster, tiny_target):
    """The state files' peak (raypipe.sizing.state_files_peak) must fit in /dev/shm beside this node's object store:
    a replica refuses, with the numbers and the fix, before it starts an engine."""
    from raypipe.shm import shm_bytes

    with pytest.raises(RuntimeError) as failed:
        deploy(serve_config(tiny_target), state_files_peak=shm_bytes() + 1)
    message = str(failed.value)
    assert "this node's /dev/shm holds " in message and "Ray's object store takes " in message, message
    assert "Fix: give /dev/shm at least " in message and "lower train.states.prefetch" in message, message
    assert APP_NAME not in serve.status().applications
