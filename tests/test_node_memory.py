"""The memory raypipe reads for vLLM's CPU engines, against vLLM's own reading, on this machine and on a small node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe.node_memory import GIB, EngineFit, NodeMemory, check_engine_memory, engine_node, node_memory
from tests.helpers import serve_config
from tests.small_node import small_node, unavailable

ROOT = Path(__file__).resolve().parents[1]
BOTH_VIEWS = """
import json
from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
from raypipe.node_memory import engine_node, node_memory
node = get_allowed_cpu_list()[0].numa_node
vllm, ours = get_memory_node_info(node), node_memory(engine_node())
print(json.dumps({"node": [node, ours.node], "total": [vllm.total_memory, ours.total],
                  "available": [vllm.available_memory, ours.available]}))
"""


def test_the_node_is_read_as_vllm_reads_it():
    """Same node, same total; the available memory moves between the two readings, by little."""
    out = json.loads(
        subprocess.run([sys.executable, "-c", BOTH_VIEWS], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    )
    assert out["node"][0] == out["node"][1] == engine_node()
    assert out["total"][0] == out["total"][1] == node_memory(engine_node()).total
    assert abs(out["available"][0] - out["available"][1]) < GIB // 4


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_small_node_is_read_as_vllm_reads_it():
    """Under a 3 GiB cgroup limit both readings see a 3 GiB node, whatever the machine has."""
    with small_node(3) as prefix:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", BOTH_VIEWS], cwd=ROOT, capture_output=True, text=True, check=True
        )
    view = json.loads(out.stdout)
    assert view["total"] == [3 * GIB, 3 * GIB]
    assert 0 < view["available"][0] < 3 * GIB and abs(view["available"][0] - view["available"][1]) < GIB // 4


def test_engines_that_do_not_fit_are_refused_with_the_numbers_and_the_setting():
    node = NodeMemory(node=0, total=16 * GIB, available=8 * GIB)
    fits = EngineFit(engines=2, weights=GIB // 2, kv_cache=GIB, node=node, machine_available=20 * GIB)
    assert fits.ok and fits.needed == 2 * (GIB // 2 + GIB + int(2.5 * GIB))
    too_big = EngineFit(engines=2, weights=GIB // 2, kv_cache=2 * GIB, node=node, machine_available=20 * GIB)
    assert not too_big.ok
    assert too_big.describe() == (
        "2 vLLM engine(s) need 10.00 GiB (each: weights 0.50 + KV cache 2.00 + engine processes 2.50 GiB); "
        "NUMA node 0: 8.00 of 16.00 GiB available (vLLM sizes its CPU engines from it), this machine 20.00 GiB"
    )
    assert (
        too_big.fix()
        == "set serve.kv_cache_gib=1 or less, or fewer engines at once (serve.max_replicas), or free memory"
    )
    machine = EngineFit(engines=1, weights=GIB // 2, kv_cache=GIB, node=node, machine_available=3 * GIB)
    assert not machine.ok and machine.fix().startswith("even without a KV cache the engines do not fit")


def test_the_check_refuses_a_kv_cache_this_machine_cannot_hold(tiny_target):
    cfg = serve_config(tiny_target, kv_cache_gib=4096)
    with pytest.raises(ValueError, match=r"serve\.kv_cache_gib: 1 vLLM engine\(s\) need 4098\.\d\d GiB .* Fix: set "):
        check_engine_memory(cfg, 1)
    check_engine_memory(serve_config(tiny_target, kv_cache_gib=0.25), 1)
    check_engine_memory(serve_config(tiny_target, kv_cache_gib=4096, num_gpus=1), 1)  # GPUs: gpu_memory_utilization
