"""The step log: which samples each optimizer step trained, kept apart from the ledger, for an audit of what the
final model saw.

Each training attempt (one start of the worker group: the first, and each
restart from a checkpoint after a failure or a resubmitted job) gets an id
that sorts by its start time. Each rank appends to
`{train.output}/steps/{name}/{attempt}.rank-{rank}.jsonl` (raypipe.layout),
first a line saying where the attempt resumed from, then one line per optimizer
step, right after it:

    {"attempt": ..., "rank": 0, "pid": 123, "world": 2, "resumed": {"epoch": 0, "step": 50, "cursor": 100},
     "total_steps": 1183}
    {"step": 51, "epoch": 0, "cursor": 100, "ids": ["sample-7", "sample-12"]}

(`step` counts optimizer steps over all epochs, 1-based; `cursor` is the
epoch's first pack of that step; a rank's padding step at an epoch's end has no
ids.) Nothing is ever rewritten or removed, unlike the ledger, which a resume
cuts back to its checkpoint: the log keeps the steps that were rolled back, and
`trained_counts` decides from it alone which steps the final model holds. A
step of an attempt survives unless a later attempt resumed from before it (it
restored an older checkpoint, so that step's update was lost with the model).
On object stores, which cannot append, each rank writes its buffered lines as
one part per checkpoint (`{attempt}.rank-{rank}.{first step}.jsonl`): an
attempt's steps after its last checkpoint are then missing, which changes no
count (they were rolled back).
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from raypipe.storage import Storage, is_url


def new_attempt() -> str:
    """An attempt id that sorts by start time: UTC to the microsecond, then a random suffix."""
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:8]}"


class StepLog:
    """One rank's log of one attempt."""

    def __init__(
        self, storage: Storage, attempt: str, rank: int, world: int, resumed: dict[str, int], total_steps: int
    ) -> None:
        self.storage, self.attempt, self.rank = storage, attempt, rank
        self.local = not is_url(storage.url)
        self.name = f"{attempt}.rank-{rank:04d}"
        self.lines: list[str] = []
        if self.local:
            os.makedirs(storage.path(), exist_ok=True)
        head = {"attempt": attempt, "rank": rank, "pid": os.getpid(), "world": world, "resumed": resumed}
        self._append({**head, "total_steps": total_steps})

    def _append(self, doc: dict[str, Any]) -> None:
        line = json.dumps(doc, separators=(",", ":")) + "\n"
        if self.local:  # one write per line, flushed: a process killed after it has it on disk
            with open(self.storage.path(f"{self.name}.jsonl"), "a") as f:
                f.write(line)
        else:
            if not self.lines:
                self.first_step = doc.get("step", 0)
            self.lines.append(line)

    def add(self, epoch: int, step: int, cursor: int, sample_ids: list[str]) -> None:
        """Optimizer step `step` (1-based, all epochs), which trained `sample_ids` from pack `cursor` of `epoch`."""
        self._append({"step": step, "epoch": epoch, "cursor": cursor, "ids": sample_ids})

    def flush(self) -> None:
        """At each checkpoint: on object stores, the lines since the last flush as one part (local files are written
        line by line)."""
        if not self.local and self.lines:
            self.storage.write(f"{self.name}.{self.first_step:09d}.jsonl", "".join(self.lines).encode())
            self.lines = []


def read_attempts(storage: Storage) -> dict[str, dict[str, Any]]:
    """Every attempt in a run's step log, in start order: {attempt: {"resumed", "total_steps", "pids": {rank: pid},
    "ranks": {rank: [step lines]}}}."""
    attempts: dict[str, dict[str, Any]] = {}
    storage.refresh()
    for rel in storage.glob("*.jsonl"):
        attempt, rank = rel.split(".rank-")[0], int(rel.split(".rank-")[1].split(".")[0])
        entry = attempts.setdefault(attempt, {"resumed": None, "ranks": {}, "pids": {}})
        for line in storage.read(rel).decode().splitlines():
            doc = json.loads(line)
            if "resumed" in doc:
                entry["resumed"], entry["total_steps"] = doc["resumed"], doc["total_steps"]
                entry["pids"][rank] = doc["pid"]
            else:
                entry["ranks"].setdefault(rank, []).append(doc)
    return dict(sorted(attempts.items()))


def surviving_steps(attempts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines whose update the final model holds: a step of attempt a is dropped when a later attempt resumed
    from a step before it."""
    names = list(attempts)
    kept = []
    for i, name in enumerate(names):
        later = [attempts[n]["resumed"]["step"] for n in names[i + 1 :] if attempts[n]["resumed"] is not None]
        cut = min(later, default=None)
        for lines in attempts[name]["ranks"].values():
            kept += [line for line in lines if cut is None or line["step"] <= cut]
    return kept


def trained_counts(storage: Storage) -> dict[int, Counter[str]]:
    """Per epoch, how many times each sample id is in a surviving step."""
    counts: dict[int, Counter[str]] = {}
    for line in surviving_steps(read_attempts(storage)):
        counts.setdefault(line["epoch"], Counter()).update(line["ids"])
    return counts


def once_twice_never(counts: dict[int, Counter[str]], sample_ids: list[str], epochs: int) -> dict[int, dict[str, int]]:
    """Per epoch, the prepared samples trained once, more than once and never (`other` counts ids not prepared)."""
    prepared = set(sample_ids)
    out = {}
    for epoch in range(epochs):
        c = counts.get(epoch, Counter())
        out[epoch] = {
            "once": sum(1 for s in prepared if c[s] == 1),
            "twice_or_more": sum(1 for s in prepared if c[s] > 1),
            "never": sum(1 for s in prepared if c[s] == 0),
            "other": sum(1 for s in c if s not in prepared),
        }
    return out
