"""Production engine: the target in vLLM, hidden states through `extract_hidden_states`.

vLLM computes the configured layers' residual streams (raypipe.serve.layers
convention, which is vLLM's own) during prefill and raypipe's connector writes
them per request to a memory-backed directory; each file is read once and
removed. The same engine serves on-policy replies.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from raypipe.config import ServeConfig
from raypipe.serve.engine import Sampling
from raypipe.serve.vllm_args import engine_args
from raypipe.target import Target


def _memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class VllmEngine:
    def __init__(self, target: Target, cfg: ServeConfig) -> None:
        from vllm import LLM

        self.layer_ids = target.layer_ids
        self.storage = Path(tempfile.mkdtemp(prefix="raypipe-hidden-", dir=_memory_dir()))
        self.llm = LLM(
            **engine_args(target, cfg),
            enable_chunked_prefill=False,  # the connector writes a request's states when its one prefill ends
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": "HiddenStatesConnector",
                "kv_connector_module_path": "raypipe.serve.connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.storage)},
            },
        )

    def _run(self, prompts: list[list[int]], params: Any) -> list[Any]:
        return self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)

    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams

        outputs = self._run(batch, SamplingParams(temperature=0.0, max_tokens=1))
        return [_take_states(out, ids) for out, ids in zip(outputs, batch)]

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Replies, through the end-of-turn token when the model emits it."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
        )
        outputs = self._run(prompts, params)
        for out in outputs:
            _remove(out.kv_transfer_params["hidden_states_path"])  # every finished request writes a file
        return [list(out.outputs[0].token_ids) for out in outputs]

    def close(self) -> None:
        self.llm = None
        shutil.rmtree(self.storage, ignore_errors=True)


def _take_states(output: Any, expected_ids: list[int]) -> torch.Tensor:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    path = output.kv_transfer_params["hidden_states_path"]
    data = load_hidden_states(path)  # waits on the writer's lock
    cleanup_hidden_states(path)
    assert data["token_ids"].tolist() == expected_ids, "hidden states of another sequence"
    return data["hidden_states"].float()


def _remove(path: str) -> None:
    """Drop a request's file once its writer is done (deleting earlier would leave it behind)."""
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    for p in (path, path + ".lock"):
        Path(p).unlink(missing_ok=True)
