"""What a training checkpoint holds, written and read the same way for DDP and FSDP2.

A checkpoint directory (uploaded by Ray Train to the run's storage):
  drafter/               save_pretrained of the drafter (speculators format, no verifier weights)
  optimizer.pt           full (unsharded) AdamW state
  scheduler.pt           LR scheduler state
  training_state.json    epoch, global step and data cursor (packs of the epoch consumed)
  config.json            the resolved run config, credentials redacted
  provenance.json        raypipe version, target and its digest, data manifest hash, library versions

The files are the parts of a TrainState's state_dict (raypipe.train.step):
full state dicts (a collective: every rank calls it), so a checkpoint written
by N workers loads on any number of workers, sharded or not. Only trainable
weights and their optimizer state are gathered; the frozen embedding and head
are replicated, and a draft vocabulary's head, the one frozen matrix saved,
is written from rank 0's own copy.

A model whose trainable parameters hold NaN or Inf on any rank is refused
before anything is written, on every rank alike: the stored checkpoints stay
the last good ones. Everything is read back with `weights_only=True`: the
optimizer and scheduler states are tensors, numbers, strings and their
containers only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from raypipe.config import redact
from raypipe.train.step import Progress, TrainState, any_rank

# The files of a checkpoint (see above), as export and the resume check read them.
DRAFTER_DIR = "drafter"
STATE_FILE = "training_state.json"
CONFIG_FILE = "config.json"
PROVENANCE_FILE = "provenance.json"


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters holding NaN or Inf on any rank (a collective: every rank gets the same
    list)."""
    named = [(name, p.detach()) for name, p in model.named_parameters() if p.requires_grad]
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]  # FSDP2: this rank's shard
    flags = any_rank(torch.stack([(~torch.isfinite(p)).any() for p in local]).to(torch.float32))
    return [name for (name, _), bad in zip(named, flags.tolist(), strict=True) if bad]


def save_checkpoint(
    directory: Path, state: TrainState, config: dict[str, Any], provenance: dict[str, Any], write: bool
) -> None:
    """Gather full states on every rank (collective); only the rank with `write` writes the files. A non-finite model is
    refused on every rank with a ValueError, before anything is gathered or written."""
    bad = nonfinite_parameters(state.model)
    if bad:
        raise ValueError(
            f"refusing to checkpoint step {state.progress.step}: {len(bad)} trainable tensors hold NaN or Inf "
            f"({', '.join(bad[:3])}); the stored checkpoints are kept. Lower train.optim.lr or "
            "train.optim.grad_clip, or look for "
            "broken rows in the prepared data"
        )
    full = state.state_dict()
    if not write:
        return
    state.drafter.save_pretrained(directory / DRAFTER_DIR, state_dict=full["model"])
    torch.save(full["optimizer"], directory / "optimizer.pt")
    torch.save(full["scheduler"], directory / "scheduler.pt")
    (directory / STATE_FILE).write_text(json.dumps(full["progress"]))
    (directory / CONFIG_FILE).write_text(json.dumps(redact(config), indent=1))  # no credentials in stored checkpoints
    (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1))


def read_progress(directory: Path) -> Progress:
    """Where the checkpoint's run stood, before anything is built from it (the schedule's length depends on it)."""
    return Progress(**json.loads((directory / STATE_FILE).read_text()))


def load_checkpoint(directory: Path, state: TrainState) -> None:
    """Restore trainable weights, optimizer, scheduler and progress into `state` on every rank."""
    state.load_state_dict(
        {
            "model": load_file(str(directory / DRAFTER_DIR / "model.safetensors")),
            "optimizer": torch.load(directory / "optimizer.pt", weights_only=True),
            "scheduler": torch.load(directory / "scheduler.pt", weights_only=True),
            "progress": json.loads((directory / STATE_FILE).read_text()),
        }
    )
