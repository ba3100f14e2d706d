"""Production engine: the target in vLLM's asynchronous engine, hidden states through `extract_hidden_states`.

vLLM computes the configured layers' residual streams (raypipe.target
convention, which is vLLM's own) during prefill, and raypipe's connector
writes them per request to this replica's directory in shared memory, under
the name the caller gives (raypipe.serve.transport hands each file on). Every
request, extraction or reply, streams through the engine's continuous batching
on its own: no lock, no merged calls. A request cancelled by its caller is
aborted in the engine (vLLM's `generate` aborts when its consumer is
cancelled): one never scheduled costs nothing and writes no file, one
scheduled writes what it computed under its known name, for the caller to
remove.
The engine core runs in a child process: it is recorded (raypipe.serve.reaper)
and ended by its pid when the engine closes, or, if this process is killed
hard, by the next engine to start on the node. When it cannot start, vLLM
raises here only "Engine core initialization failed. See root cause above":
the cause is in what its processes logged to this process's output (in a Ray
worker, its log files), so the start reads it back from there and raises
EngineStartError with vLLM's own error and the serve.* setting that fixes it.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from pathlib import Path
from typing import Any

from raypipe.config import ServeConfig
from raypipe.serve.engine import Sampling
from raypipe.serve.reaper import engine_processes
from raypipe.serve.transport import discard
from raypipe.serve.vllm_args import service_args, start_fix
from raypipe.target import Target

# A vLLM log line with an exception: "(Worker pid=9012) ERROR 12-01 10:57:05 [core.py:1063] ValueError: ..."
VLLM_ERROR = re.compile(r"\bERROR \S+ \S+ \[[^\]]+\] ((?:\w+\.)*\w+(?:Error|Exception): .*)")


class EngineStartError(RuntimeError):
    """vLLM's engine did not start: its own error, and the setting that fixes it."""


def _output_files() -> dict[str, int]:
    """This process's stdout and stderr where they are files (a Ray worker's logs), with their sizes now; vLLM's
    processes inherit them and log there."""
    files = {}
    for fd in (1, 2):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            files[path] = os.path.getsize(path)
    return files


def logged_error(since: dict[str, int]) -> str | None:
    """The first exception vLLM's processes logged to the files `since` their offsets there: the root cause."""
    for path, offset in since.items():
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                if found := VLLM_ERROR.search(line):
                    return found.group(1)
    return None


def start_error(err: Exception, since: dict[str, int]) -> EngineStartError:
    """The start-up failure as one line: vLLM's logged root cause (else the exception raised here) and its fix."""
    cause = logged_error(since) or f"{type(err).__name__}: {' '.join(str(err).split())}"
    fix = start_fix(cause)
    return EngineStartError(f"vLLM did not start: {cause}" + (f" Fix: {fix}" if fix else ""))


class VllmEngine:
    def __init__(self, target: Target, cfg: ServeConfig, directory: Path) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        self.directory = directory
        args = AsyncEngineArgs(
            **service_args(target, cfg),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(target.layer_ids)}},
            },
            kv_transfer_config=KVTransferConfig(
                kv_connector="HiddenStatesConnector",
                kv_connector_module_path="raypipe.compat.vllm_connector",
                kv_role="kv_producer",
                # Each request's file is named by the caller (a cancelled request's file can then be found and
                # removed); only raypipe's own code submits requests to this engine.
                kv_connector_extra_config={"shared_storage_path": str(directory), "allow_custom_save_path": True},
            ),
        )
        self.aborted = 0  # requests cancelled before their end, aborted in the engine
        output = _output_files()
        with engine_processes() as self.processes:
            try:
                self.llm = AsyncLLM.from_engine_args(args)
            except Exception as err:
                raise start_error(err, output) from err

    def path(self, name: str | None = None) -> str:
        """Where the connector writes the states of the request called `name` (a fresh name when None)."""
        return str(self.directory / f"{name or uuid.uuid4().hex}.safetensors")

    async def _final(self, ids: list[int], params: Any, path: str) -> Any:
        """The request's final output, its states written to `path`. Cancelled, vLLM aborts it in the engine."""
        params.extra_args = {"kv_transfer_params": {"hidden_states_path": path}}
        final = None
        try:
            async for output in self.llm.generate({"prompt_token_ids": ids}, params, request_id=uuid.uuid4().hex):
                final = output
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        assert final is not None and final.finished
        assert final.kv_transfer_params["hidden_states_path"] == path, "the connector ignored the request's path"
        return final

    async def extract(self, ids: list[int], name: str | None = None) -> str:
        """The path of the file the connector writes this sequence's states to (raypipe.serve.transport reads it)."""
        from vllm import SamplingParams

        path = self.path(name)
        await self._final(ids, SamplingParams(temperature=0.0, max_tokens=1), path)
        return path

    async def generate(self, ids: list[int], sampling: Sampling, name: str | None = None) -> list[int]:
        """A reply, through the end-of-turn token when the model emits it. Its states are written too (every finished
        request's are) and removed here."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
        )
        path = self.path(name)
        final = await self._final(ids, params, path)
        await asyncio.to_thread(discard, path)
        return list(final.outputs[0].token_ids)

    @property
    def engine_pids(self) -> list[int]:
        """The engine's processes (its core, and workers with tensor parallelism)."""
        return self.processes.pids

    async def check_health(self) -> None:
        """Raises if the engine core died; never waits behind requests."""
        await self.llm.check_health()

    def close(self) -> None:
        """vLLM's own shutdown, then whatever of its processes is left, by pid."""
        self.llm.shutdown()
        self.processes.reap()
