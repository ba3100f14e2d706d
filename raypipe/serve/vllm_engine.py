"""Production engine: the target in vLLM, hidden states through `extract_hidden_states`.

vLLM computes the configured layers' residual streams (raypipe.serve.layers
convention, which is vLLM's own) during prefill and raypipe's connector writes
them per request to a memory-backed directory; each file is read once and
removed. The same engine serves on-policy replies; with `with_states` a reply
comes back with the states of prompt + reply from the same call.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from raypipe.serve.engine import Sampling
from raypipe.serve.layers import check_layer_ids


def _memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class VllmEngine:
    def __init__(
        self,
        model_dir: str,
        layer_ids: tuple[int, ...],
        *,
        dtype: str = "auto",
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
    ) -> None:
        from vllm import LLM

        config = AutoConfig.from_pretrained(model_dir)
        check_layer_ids(layer_ids, config.num_hidden_layers)
        self.layer_ids = tuple(layer_ids)
        self.hidden_size = config.hidden_size
        self.max_model_len = max_model_len
        self.storage = Path(tempfile.mkdtemp(prefix="raypipe-hidden-", dir=_memory_dir()))
        self.engine_calls = 0
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
            disable_log_stats=False,
            seed=0,
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
        self.engine_calls += 1
        return self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)

    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams

        outputs = self._run(batch, SamplingParams(temperature=0.0, max_tokens=1))
        return [_take_states(out, ids) for out, ids in zip(outputs, batch)]

    def generate(self, prompts: list[list[int]], sampling: Sampling, with_states: bool = False) -> Any:
        """Replies; with `with_states`, also the states of prompt + reply (all but the last reply token)."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}} if with_states else None,
        )
        outputs = self._run(prompts, params)
        replies = [list(out.outputs[0].token_ids) for out in outputs]
        if not with_states:
            for out in outputs:
                _remove(out.kv_transfer_params["hidden_states_path"])  # every finished request writes a file
            return replies
        states = [_take_states(out, ids + reply[:-1]) for out, ids, reply in zip(outputs, prompts, replies)]
        return replies, states

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
