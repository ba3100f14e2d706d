"""The order of an epoch and the learning-rate schedule: pure, deterministic functions.

Rows are addressed by their global index in the prepared dataset (its shards
in manifest order). An epoch shuffles the shards, then the rows inside windows
of `window` shards (so a worker holds one window of shards at a time, not the
dataset), and packs rows greedily in that order into packs of at most `budget`
tokens. Step s of a world of W workers trains packs s*W .. s*W+W-1, worker w
taking pack s*W+w. The data cursor is the number of packs consumed: a resume
continues at the exact pack, even on a different number of workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def epoch_order(shard_sizes: list[int], seed: int, epoch: int, window: int) -> np.ndarray:
    """Global row indices of one epoch: shards shuffled, rows shuffled within windows of shards."""
    rng = np.random.default_rng([seed, epoch])
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)])
    shards = rng.permutation(len(shard_sizes))
    parts = []
    for start in range(0, len(shards), window):
        rows = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in shards[start : start + window]])
        parts.append(rng.permutation(rows))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def pack_rows(order: np.ndarray, lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive rows of `order` grouped into packs of at most `budget` tokens (greedy, order kept)."""
    packs: list[np.ndarray] = []
    start, used = 0, 0
    for i, row in enumerate(order):
        n = int(lengths[row])
        if n > budget:
            raise ValueError(
                f"row {row} has {n} tokens, more than train.schedule.step_tokens={budget}; raise "
                "train.schedule.step_tokens or lower "
                "data.max_length"
            )
        if used + n > budget:
            packs.append(order[start:i])
            start, used = i, 0
        used += n
    if start < len(order):
        packs.append(order[start:])
    return packs


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    packs: list[np.ndarray]

    def steps(self, world: int, cursor: int = 0) -> int:
        """Steps left in the epoch from `cursor` packs consumed."""
        return math.ceil(max(len(self.packs) - cursor, 0) / world)

    def pack_index(self, cursor: int, step: int, rank: int, world: int) -> int | None:
        """The pack rank trains at `step` steps after `cursor`; None when the epoch ran out (the rank idles that
        step)."""
        index = cursor + step * world + rank
        return index if index < len(self.packs) else None


def total_steps(plans: list[EpochPlan], world: int, epoch: int, cursor: int, done: int, cap: int | None) -> int:
    """The run's optimizer steps when `done` were taken and the data stands at (`epoch`, `cursor`): those plus the
    steps left at this world size, capped by train.schedule.max_steps. A resume on another number of workers takes
    what is left at its own size (steps taken before count as they were): never fewer packs, never more."""
    left = sum(plan.steps(world, cursor if plan.epoch == epoch else 0) for plan in plans if plan.epoch >= epoch)
    return done + left if cap is None else min(done + left, cap)


def plan_epoch(
    shard_sizes: list[int], lengths: np.ndarray, *, seed: int, epoch: int, window: int, budget: int
) -> EpochPlan:
    return EpochPlan(epoch, pack_rows(epoch_order(shard_sizes, seed, epoch, window), lengths, budget))


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at `total_steps` (a function of the step alone, so resume is
    exact)."""
    warmup = max(1, round(total_steps * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
