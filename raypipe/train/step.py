"""One optimizer step of the drafter on its device: precision, placement, the state a step changes and the step
itself (no Ray).

Kept apart from the loop so the GPU check (bench/gpu_check.py) runs exactly
this code on a machine without Ray.

`TrainState` bundles what a step changes and a checkpoint holds: the
drafter (unwrapped and as placed), optimizer, schedule, progress, and the
settings every step uses. Like torchtitan's stateful components, its
`state_dict` / `load_state_dict` are what a checkpoint saves and restores
(raypipe.train.checkpoint lays them out in files).

A step whose loss or gradient norm is NaN or Inf is skipped on the device,
without a host sync: AdamW is fused, and its step takes a `found_inf` flag
(as under torch's GradScaler) that leaves parameters, moments and step count
untouched. Every rank agrees on the flag (an all-reduce), so DDP and FSDP2
ranks never diverge. The loop counts skipped steps (raypipe.train.metrics).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from raypipe.config import TrainConfig
from raypipe.train.drafter import step_kwargs
from raypipe.train.plan import lr_factor

NONFINITE = "nonfinite"  # key of the step's skip flag among the metrics train_step returns


def precision(device: torch.device) -> tuple[AbstractContextManager[Any], torch.dtype]:
    """(autocast, states dtype): bf16 on GPU; fp32 on CPU, where the served bf16 states are widened."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16), torch.bfloat16
    return torch.autocast("cpu", enabled=False), torch.float32


def place_drafter(drafter: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """The drafter on `device`, wrapped for data parallelism.

    On GPUs the frozen embedding and head (the target's, the largest tensors
    of a drafter) are stored in bf16, and FSDP2 gathers parameters in bf16 and
    reduces gradients in fp32. FSDP2 shards only what trains: the frozen
    parameters are `ignored_params`, plain tensors replicated on every rank,
    because sharded they would be all-gathered at every step and at every
    checkpoint for no gradient (7.6 GB per step at Qwen3.6-27B's shape, three
    248320 x 5120 bf16 matrices before the heads were shared). FSDP2 neither
    moves nor casts ignored parameters: they are on `device`, in bf16 on GPUs,
    before it wraps.
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
        frozen = {p for p in drafter.parameters() if not p.requires_grad}
        return fully_shard(drafter, mp_policy=policy, ignored_params=frozen)
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


@dataclass
class Progress:
    """Where training stands: what a resume continues from."""

    epoch: int = 0
    step: int = 0  # optimizer steps taken, all epochs
    cursor: int = 0  # packs of `epoch` consumed (raypipe.train.plan)


@dataclass
class TrainState:
    """What a training step changes and a checkpoint holds, with the settings every step uses."""

    drafter: Any  # the speculators drafter: its save_pretrained writes a checkpoint's weights
    model: torch.nn.Module  # the drafter as placed (DDP, FSDP2, or the drafter itself)
    optimizer: torch.optim.Optimizer  # fused AdamW (make_optimizer)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    kwargs: dict[str, Any]  # the drafter's forward settings (raypipe.train.drafter.step_kwargs)
    autocast: AbstractContextManager[Any]
    progress: Progress = field(default_factory=Progress)
    params: list[torch.nn.Parameter] = field(init=False)  # the trainable ones, clipped each step

    def __post_init__(self) -> None:
        assert self.optimizer.defaults.get("fused"), (
            "train_step skips non-finite steps through fused AdamW's found_inf: build the optimizer with make_optimizer"
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    @classmethod
    def create(
        cls, drafter: Any, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, total_steps: int
    ) -> TrainState:
        """A run's state at step 0: AdamW and the warm-up and cosine schedule over `total_steps` from `train.optim`."""
        optimizer = make_optimizer(
            [p for p in model.parameters() if p.requires_grad], cfg.optim.lr, cfg.optim.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total_steps, cfg.optim.warmup_ratio)
        )
        return cls(drafter, model, optimizer, scheduler, cfg.optim.grad_clip, step_kwargs(cfg), precision(device)[0])

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) weights (`model_state_dict`) and optimizer state on the CPU, schedule and progress. A
        collective (every rank calls it): the same dict whatever the placement, so a checkpoint loads on any number
        of workers."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": self.model_state_dict(),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
            "progress": asdict(self.progress),
        }

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """What the drafter's save_pretrained writes, on the CPU of rank 0 (empty on the others, like torch's full
        state dicts with cpu_offload): the trainable weights gathered whole, the buffers and, with a draft
        vocabulary, the LM head, which vLLM reads from the checkpoint; a collective.

        The frozen parameters are replicated (`place_drafter`), so none is gathered: the draft vocabulary's head is
        rank 0's own copy; the embedding and full-vocabulary heads are the target's, never saved. Not torch's
        `ignore_frozen_params`: it drops only the first name of the shared head, and copies verifier_lm_head whole
        to the CPU."""
        keep = not dist.is_initialized() or dist.get_rank() == 0
        frozen = {name for name, p in self.drafter.named_parameters(remove_duplicate=False) if not p.requires_grad}
        weights: dict[str, torch.Tensor] = {}
        for name, value in self.drafter.state_dict().items():
            if name in frozen:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2: a collective
            if keep:
                weights[name] = full.detach().cpu()
        if keep and self.drafter.use_draft_vocab:
            weights["lm_head.weight"] = self.drafter.lm_head.weight.detach().cpu()
        return weights

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` on every rank; "model" holds the trainable weights (the frozen ones come from the
        target; a draft vocabulary's LM head, equal to the target's rows, is loaded too)."""
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        self.progress = Progress(**state["progress"])


def train_step(
    state: TrainState, batch: dict[str, torch.Tensor], max_anchors: int, weight: float = 1.0
) -> dict[str, torch.Tensor]:
    """One optimizer step on one packed sequence (`max_anchors`: its anchors, raypipe.train.anchors.anchor_count;
    `weight` 0 for a rank's padding step); returns the drafter's metrics and `NONFINITE` (1.0 when the step was
    skipped), all device tensors, none read here. The schedule advances either way: it follows the data, not the
    updates. `state.progress` is the caller's to advance."""
    with state.autocast:
        _, loss, model_metrics = state.model(**batch, **state.kwargs, max_anchors=max_anchors)
    (loss * weight).backward()
    norm = torch.nn.utils.clip_grad_norm_(state.params, state.grad_clip)
    if isinstance(norm, DTensor):  # FSDP2: a collective, the same on every rank
        norm = norm.full_tensor()
    skipped = any_rank((~(torch.isfinite(loss.detach()) & torch.isfinite(norm))).to(torch.float32))
    state.optimizer.found_inf = skipped  # type: ignore[attr-defined]  # read by the fused step: no update where it is 1
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return {**model_metrics, NONFINITE: skipped}
