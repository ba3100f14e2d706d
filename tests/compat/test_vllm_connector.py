"""vLLM 0.32's example hidden-states KV connector, whose private write path raypipe.compat.vllm_connector overrides for
the CPU engine: the parent still sets what the override reads, and the override with the parent's own write thread
and callbacks writes a request's states as the parent would. tests/serve/test_vllm_engine.py runs it in a real
engine."""

from __future__ import annotations

import ast
import fcntl
import inspect
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from raypipe.compat.vllm_connector import HiddenStatesConnector

# What HiddenStatesConnector._submit_async_write reads or fills on the instance.
READ = {"_kv_cache", "_is_tp_rank_zero", "_block_size", "_lock_fds", "use_lock", "_req_futures", "_req_copy_events",
        "_executor"}  # fmt: skip


def assigned(cls: type, method: str) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_the_parent_sets_every_attribute_the_override_reads_and_keeps_its_private_methods() -> None:
    missing = (
        READ
        - assigned(ExampleHiddenStatesConnector, "__init__")
        - assigned(ExampleHiddenStatesConnector, "register_kv_caches")
    )
    assert not missing, f"vLLM's ExampleHiddenStatesConnector no longer sets {missing}"
    signatures = {
        name: list(inspect.signature(getattr(ExampleHiddenStatesConnector, name)).parameters)
        for name in ("_submit_async_write", "_write_tensors", "_on_write_done")
    }
    assert signatures == {
        "_submit_async_write": ["self", "pending"],
        "_write_tensors": ["tensors", "event", "filename", "lock_fd"],
        "_on_write_done": ["self", "req_id", "future"],
    }


def test_a_finished_requests_states_are_written_from_host_memory_and_the_lock_released(tmp_path: Path) -> None:
    connector = HiddenStatesConnector.__new__(HiddenStatesConnector)  # the fields __init__/register_kv_caches set
    kv_cache = torch.randn(4, 2, 3, 8)  # [blocks, layers, block size, hidden]
    connector._kv_cache, connector._is_tp_rank_zero, connector._block_size = kv_cache, True, 3
    connector._lock_fds, connector.use_lock, connector._req_futures, connector._req_copy_events = {}, True, {}, {}
    connector._executor = ThreadPoolExecutor(1)
    filename = str(tmp_path / "states" / "req.safetensors")
    connector._submit_async_write(PendingSave("req", filename, torch.arange(5), block_ids=[2, 0]))
    connector._executor.shutdown(wait=True)
    written = load_file(filename)
    want = torch.cat([kv_cache[2], kv_cache[0]], dim=1).transpose(0, 1)[:5]  # slots 6, 7, 8, 0, 1
    assert torch.equal(written["hidden_states"], want) and written["token_ids"].tolist() == [0, 1, 2, 3, 4]
    assert connector._req_futures == {}  # the parent's _on_write_done dropped the finished write
    fd = os.open(filename + ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the parent's _write_tensors closed the writer's lock
    finally:
        os.close(fd)
