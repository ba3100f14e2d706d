"""One optimizer step of the drafter on its device: precision, placement and the step itself (torch only).

Kept apart from the loop so the GPU check (bench/gpu_check.py) runs exactly
this code on a machine without Ray.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch


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

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
        for layer in drafter.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(drafter, mp_policy=policy)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None)


def train_step(
    model: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: Any,
    batch: dict[str, torch.Tensor], kwargs: dict[str, Any], grad_clip: float, weight: float, autocast: AbstractContextManager[Any],
) -> dict[str, torch.Tensor]:
    """One optimizer step on one packed sequence; the drafter computes loss and metrics (device tensors, not read here)."""
    with autocast:
        _, loss, model_metrics = model(**batch, **kwargs)
    (loss * weight).backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return model_metrics
