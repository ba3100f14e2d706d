"""What a training checkpoint holds, written and read the same way for DDP and FSDP2.

A checkpoint directory (uploaded by Ray Train to the run's storage):
  drafter/               save_pretrained of the drafter (speculators format, no verifier weights)
  optimizer.pt           full (unsharded) AdamW state
  scheduler.pt           LR scheduler state
  training_state.json    epoch, global step and data cursor (packs of the epoch consumed)
  config.json            the resolved run config, credentials redacted
  provenance.json        raypipe version, target, data manifest hash, library versions

Full state dicts are gathered with torch.distributed.checkpoint's state-dict
API (a collective: every rank calls it), so a checkpoint written by N workers
loads on any number of workers, sharded or not.

A model whose trainable parameters hold NaN or Inf on any rank is refused
before anything is written, on every rank alike: the stored checkpoints stay
the last good ones. Everything is read back with `weights_only=True`: the
optimizer and scheduler states are tensors, numbers, strings and their
containers only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from raypipe.config import redact
from raypipe.train.step import any_rank

# The files of a checkpoint (see above), as export and the resume check read them.
DRAFTER_DIR = "drafter"
STATE_FILE = "training_state.json"
CONFIG_FILE = "config.json"
PROVENANCE_FILE = "provenance.json"


@dataclass
class TrainingState:
    epoch: int = 0
    step: int = 0  # optimizer steps taken, all epochs
    cursor: int = 0  # packs of `epoch` consumed (raypipe.train.plan)


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters holding NaN or Inf on any rank (a collective: every rank gets the same
    list)."""
    named = [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad]
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]  # FSDP2: this rank's shard
    flags = any_rank(torch.stack([(~torch.isfinite(p)).any() for p in local]).to(torch.float32))
    return [name for (name, _), bad in zip(named, flags.tolist(), strict=True) if bad]


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    drafter: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainingState,
    config: dict[str, Any],
    provenance: dict[str, Any],
    write: bool,
) -> None:
    """Gather full states on every rank (collective); only the rank with `write` writes the files. A non-finite model is
    refused on every rank with a ValueError, before anything is gathered or written."""
    bad = nonfinite_parameters(model)
    if bad:
        raise ValueError(
            f"refusing to checkpoint step {state.step}: {len(bad)} trainable tensors hold NaN or Inf "
            f"({', '.join(bad[:3])}); the stored checkpoints are kept. Lower train.optim.lr or "
            "train.optim.grad_clip, or look for "
            "broken rows in the prepared data"
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not write:
        return
    drafter.save_pretrained(directory / DRAFTER_DIR, state_dict=model_state)
    torch.save(optim_state, directory / "optimizer.pt")
    torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    (directory / STATE_FILE).write_text(json.dumps(asdict(state)))
    (directory / CONFIG_FILE).write_text(json.dumps(redact(config), indent=1))  # no credentials in stored checkpoints
    (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1))


def load_checkpoint(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainingState:
    """Restore trainable weights, optimizer and scheduler on every rank; returns where training stopped."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, load_file(str(directory / DRAFTER_DIR / "model.safetensors")), options=options)
    set_optimizer_state_dict(
        model, optimizer, torch.load(directory / "optimizer.pt", weights_only=True), options=options
    )
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
    return TrainingState(**json.loads((directory / STATE_FILE).read_text()))
