"""One optimizer step of the drafter on its device: precision, placement and the step itself (torch only).

Kept apart from the loop so the GPU check (bench/gpu_check.py) runs exactly
this code on a machine without Ray.

A step whose loss or gradient norm is NaN or Inf is skipped on the device,
without a host sync: AdamW is fused, and its step takes a `found_inf` flag
(as under torch's GradScaler) that leaves parameters, moments and step count
untouched. Every rank agrees on the flag (an all-reduce), so DDP and FSDP2
ranks never diverge. The loop counts skipped steps (raypipe.train.metrics).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

NONFINITE = "nonfinite"  # key of the step's skip flag among the metrics train_step returns


def precision(device: torch.device) -> tuple[AbstractContextManager[Any], torch.dtype]:
    """(autocast, states dtype): bf16 on GPU; fp32 on CPU, where the served bf16 states are widened."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16), torch.bfloat16
    return torch.autocast("cpu", enabled=False), torch.float32


def place_drafter(drafter: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """The drafter on `device`, wrapped for data parallelism.

    On GPUs the frozen embedding and heads (the target's, the largest tensors
    of a drafter) are stored in bf16, and FSDP2 gathers parameters in bf16 and
    reduces gradients in fp32.
    """
    drafter = drafter.to(device)
    if device.type == "cuda":
        for param in drafter.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        for layer in drafter.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(drafter, mp_policy=policy)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused: the only form whose step skips a non-finite step on the device (`found_inf`)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def any_rank(flag: torch.Tensor) -> torch.Tensor:
    """`flag` (0 or 1, in place) set on every rank of the process group if set on any: every rank takes the same
    branch."""
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def train_step(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batch: dict[str, torch.Tensor],
    kwargs: dict[str, Any],
    grad_clip: float,
    weight: float,
    autocast: AbstractContextManager[Any],
) -> dict[str, torch.Tensor]:
    """One optimizer step on one packed sequence; returns the drafter's metrics and `NONFINITE` (1.0 when the step was
    skipped), all device tensors, none read here. The schedule advances either way: it follows the data, not the
    updates."""
    assert optimizer.defaults.get("fused"), (
        "train_step skips non-finite steps through fused AdamW's found_inf: build the optimizer with make_optimizer"
    )
    with autocast:
        _, loss, model_metrics = model(**batch, **kwargs)
    (loss * weight).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if isinstance(norm, DTensor):  # FSDP2: a collective, the same on every rank
        norm = norm.full_tensor()
    skipped = any_rank((~(torch.isfinite(loss.detach()) & torch.isfinite(norm))).to(torch.float32))
    optimizer.found_inf = skipped  # type: ignore[attr-defined]  # read by the fused step: no update where it is 1
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {**model_metrics, NONFINITE: skipped}
