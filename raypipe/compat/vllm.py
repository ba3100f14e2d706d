"""vLLM 0.32's private and engine-internal functions that the serving contract (raypipe.train.contract_sides) calls
to learn what vLLM will apply to an exported DFlash drafter, without starting an engine; and the in-place reload of
a running engine's drafter that the measurements during training use (raypipe.eval.probe).

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


def reload_drafter(worker: Any, weights: bytes) -> int:
    """Load a DFlash drafter's weights (a model.safetensors file's bytes, as exported) into a running engine's
    drafter, in place; returns how many linear layers were re-packed. Called on each worker through
    `LLM.collective_rpc`.

    Relies on (0.32): the worker's `model_runner.drafter.model` is the DFlash model, whose `load_weights` takes the
    exported names and rebuilds its fused context-KV buffers (`_build_fused_kv_buffers`) from the loaded weights.
    On CPU, `UnquantizedLinearMethod.process_weights_after_loading` packs each linear layer's weight for oneDNN and
    replaces the weight with an empty tensor: those layers are first restored from the metadata vLLM recorded at
    model creation (`reload.layerwise.get_layerwise_info`, `reload.meta.restore_layer_on_meta`,
    `materialize_layer`), loaded, then packed again. vLLM's own `reload_weights` cannot be used: its layer-by-layer
    processing packs the QKV weights before DFlash's `load_weights` builds the fused buffers from them. The vocabulary
    matrices are frozen in training, so their packed copies stay valid. On an upgrade run tests/compat/ (the reloaded
    engine's replies and counters must equal a fresh engine's).
    """
    import torch
    from safetensors.torch import load as load_safetensors
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    model = worker.model_runner.drafter.model
    packed = [
        m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.numel() == 0
    ]
    for layer in packed:
        info = get_layerwise_info(layer)
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
    model.load_weights(load_safetensors(weights).items())
    for layer in packed:
        layer.quant_method.process_weights_after_loading(layer)
    return len(packed)
