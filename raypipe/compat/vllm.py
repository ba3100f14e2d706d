"""vLLM 0.32's private and engine-internal functions that the serving contract (raypipe.train.contract_sides) calls
to learn what vLLM will apply to an exported DFlash drafter, without starting an engine.

The other reach-ins into vLLM live beside this module: `vllm_connector` (a subclass of its example hidden-states
KV connector) and `vllm_cpu_fixes` (two kernels of its CPU build replaced). On an upgrade: run tests/compat/, and
read vllm/model_executor/models/qwen3_dflash.py and vllm/v1/worker/gpu/spec_decode/ against the docstrings below.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def layer_attention(hf_config: Any, layer: int) -> tuple[int | None, bool]:
    """(sliding window or None, causal) that vLLM's DFlash model gives draft layer `layer` of this config.

    Relies on (0.32): `vllm.model_executor.models.qwen3_dflash._resolve_layer_attention(config, layer_idx)`, which
    `DFlashQwen3DecoderLayer` calls per layer; it raises ValueError or NotImplementedError for a config it refuses.
    On an upgrade check that the model still builds its layers' attention from this function.
    """
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

    return _resolve_layer_attention(hf_config, layer)


def aux_layer_ids(hf_config: Any) -> list[int]:
    """The target layers whose hidden states vLLM's runner hands the drafter of this config.

    Relies on (0.32): `vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils.get_eagle3_aux_layers_from_config(spec)`,
    which reads only `spec.draft_model_config.hf_config` (a DFlash config's `dflash_config.target_layer_ids`, each
    plus 1). On an upgrade check that the function reads no other field of the speculative config.
    """
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    return list(get_eagle3_aux_layers_from_config(spec) or ())


def parallel_drafting_token_id(hf_config: Any) -> int | None:
    """The token vLLM puts in a draft block's slots for this drafter config; None when it finds none.

    Relies on (0.32): `vllm.v1.worker.gpu.spec_decode.utils.get_parallel_drafting_token_id(hf_config)`, which
    raises ValueError when no mask token is named and TypeError for `dflash_config.mask_token_id: null`. On an
    upgrade check that it still raises (and does not return a default) for a config without one.
    """
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    try:
        return get_parallel_drafting_token_id(hf_config)
    except (TypeError, ValueError):
        return None
