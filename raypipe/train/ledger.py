"""The ledger: what each rank trained between checkpoints, and the training curve.

Written with each checkpoint to the run's ledger folder (raypipe.layout): per rank,
the sample ids trained since the previous checkpoint; on rank 0, the metrics
of every logged interval. It is the audit trail of exactly-once (a resumed run
drops the segments after its checkpoint and writes them again) and the
training curve (loss, estimated acceptance) that the evaluation plots.
"""

from __future__ import annotations

import json
import os
from typing import Any

from raypipe.storage import Storage


class Ledger:
    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage = storage
        self.rank = rank
        self.ids: list[str] = []
        self.steps: list[dict[str, float]] = []
        self.start: tuple[int, int] | None = None

    def add(self, epoch: int, cursor: int, sample_ids: list[str]) -> None:
        """Samples trained by this rank in the step that began at `cursor` of `epoch`."""
        if self.start is None:
            self.start = (epoch, cursor)
        self.ids.extend(sample_ids)

    def log(self, metrics: dict[str, float]) -> None:
        """One logged interval's metrics (rank 0)."""
        self.steps.append(metrics)

    def flush(self, end_cursor: int) -> None:
        if self.start is not None:
            epoch, start = self.start
            doc = {
                "epoch": epoch,
                "packs": [start, end_cursor],
                "rank": self.rank,
                "pid": os.getpid(),
                "sample_ids": self.ids,
                "steps": self.steps,
            }
            self.storage.write_json(
                f"epoch-{epoch:04d}/packs-{start:09d}-{end_cursor:09d}.rank-{self.rank:04d}.json", doc
            )
        self.ids, self.steps, self.start = [], [], None

    def drop_after(self, epoch: int, cursor: int) -> None:
        """Forget segments of an interrupted attempt that start at or after the resumed cursor."""
        for rel in self.storage.glob(f"epoch-{epoch:04d}/packs-*.json"):
            if int(rel.rsplit("/", 1)[1].split("-")[1]) >= cursor:
                self.storage.fs.rm(self.storage.path(rel))
        for later in self.storage.glob("epoch-*"):
            if int(later.rsplit("-", 1)[1]) > epoch:
                self.storage.fs.rm(self.storage.path(later), recursive=True)


def read_ledger(ledger: Storage, epoch: int) -> list[dict[str, Any]]:
    """The segments of one epoch in a run's ledger (what each rank trained, checkpoint to checkpoint)."""
    return [json.loads(ledger.read(rel)) for rel in ledger.glob(f"epoch-{epoch:04d}/packs-*.json")]


def read_training_curve(ledger: Storage) -> list[dict[str, float]]:
    """Every logged interval's metrics in a run's ledger (rank 0's entries), in step order."""
    epochs = sorted(int(rel.rsplit("-", 1)[1]) for rel in ledger.glob("epoch-*"))
    return sorted((s for e in epochs for seg in read_ledger(ledger, e) for s in seg["steps"]), key=lambda s: s["step"])
