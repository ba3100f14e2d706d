"""raypipe's KV connector for vLLM's `extract_hidden_states`: works on CUDA and on CPU.

With `speculative_config={"method": "extract_hidden_states", ...}` vLLM keeps the
requested layers' hidden states per token in a cache-only KV slot; when a request
finishes, a KV connector writes them to `<storage>/<request id>.safetensors`
(`hidden_states [tokens, n_layers, hidden]`, `token_ids [tokens]`) guarded by a
`.lock` file, and returns the path in `RequestOutput.kv_transfer_params`.
vLLM's `ExampleHiddenStatesConnector` copies device to host through a CUDA
stream into pinned memory, which fails on the CPU engine ("pin_memory=True
requires a CUDA or other accelerator backend"). Here the KV cache already is
host memory: the request's slots are gathered synchronously (a copy, so the
blocks may be freed at once) and written by the parent's writer threads.
On CUDA the parent's path is used unchanged. raypipe.serve.vllm_engine names this module in its
`kv_connector_module_path`.

Relies on (vLLM 0.32, vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py): the
parent's private `_submit_async_write(pending)`, called once per finished request; its helpers
`_write_tensors(tensors, event, filename, lock_fd)` (waits on `event.synchronize()`, writes, closes the lock) and
`_on_write_done(req_id, future)`; the attributes its `__init__` and `register_kv_caches` set (`_kv_cache`,
`_is_tp_rank_zero`, `_block_size`, `_lock_fds`, `_req_futures`, `_req_copy_events`, `_executor`, `use_lock`);
`PendingSave` and `extract_from_kv_cache`. On an upgrade: tests/compat/test_vllm_connector.py, then
tests/serve/test_vllm_engine.py (a real engine writing real files).

Importable only where vLLM is installed (inside the engine's processes).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """A finished copy: stands in for the parent's torch.cuda.Event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda or not self._is_tp_rank_zero:
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (
            torch.arange(self._block_size, dtype=torch.long)[None, :] + blocks[:, None] * self._block_size
        ).flatten()
        tensors = {
            "hidden_states": extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        assert pending.req_id not in self._req_futures, "two writes in flight for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
