"""The step log (raypipe.train.steplog): what each attempt wrote, and which of its steps the final model holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypipe.storage import Storage
from raypipe.train.steplog import StepLog, new_attempt, once_twice_never, read_attempts, trained_counts


def _attempt(storage: Storage, world: int, resumed: int, steps: range, cursor_of, ids_of) -> str:
    """One attempt of `world` ranks resumed from step `resumed` that took `steps` (each rank one pack a step)."""
    attempt = new_attempt()
    logs = [
        StepLog(storage, attempt, r, world, {"epoch": 0, "step": resumed, "cursor": resumed * world}, 40)
        for r in range(world)
    ]
    for step in steps:
        for rank, log in enumerate(logs):
            log.add(0, step, cursor_of(step), ids_of(step, rank))
    for log in logs:
        log.flush()
    return attempt


@pytest.mark.parametrize("where", ["local", "memory"])
def test_rolled_back_steps_are_dropped_and_every_sample_counts_once(tmp_path: Path, where: str) -> None:
    """Two ranks, 40 steps of one pack each (80 samples): the first attempt dies at step 25 after its checkpoint at
    20, the second resumes from 20 and dies at 33 after a checkpoint at 30 that was never registered, the third
    resumes from 20 again and finishes. The log keeps every step written; the count keeps each sample once."""
    url = str(tmp_path / "steps") if where == "local" else f"memory://steplog-{tmp_path.name}"
    storage = Storage(url, {})

    def ids(step: int, rank: int) -> list[str]:
        return [f"s{2 * (step - 1) + rank}"]

    def cursor(step: int) -> int:
        return 2 * (step - 1)

    first = _attempt(storage, 2, 0, range(1, 26), cursor, ids)
    _attempt(storage, 2, 20, range(21, 34), cursor, ids)
    _attempt(storage, 2, 20, range(21, 41), cursor, ids)
    attempts = read_attempts(storage)
    assert list(attempts)[0] == first and [a["resumed"]["step"] for a in attempts.values()] == [0, 20, 20]
    assert sum(len(lines) for a in attempts.values() for lines in a["ranks"].values()) == 2 * (25 + 13 + 20)
    counts = trained_counts(storage)
    assert counts[0] == {f"s{i}": 1 for i in range(80)}
    prepared = [f"s{i}" for i in range(81)]  # one more prepared than trained: never
    assert once_twice_never(counts, prepared, 2) == {
        0: {"once": 80, "twice_or_more": 0, "never": 1, "other": 0},
        1: {"once": 0, "twice_or_more": 0, "never": 81, "other": 0},
    }


def test_a_step_trained_twice_is_seen(tmp_path: Path) -> None:
    """A resume that restored step 20 but started again from an earlier cursor repeats samples: the count shows it."""
    storage = Storage(str(tmp_path), {})
    _attempt(storage, 1, 0, range(1, 21), lambda s: s - 1, lambda s, r: [f"s{s - 1}"])
    _attempt(storage, 1, 20, range(21, 31), lambda s: s - 11, lambda s, r: [f"s{s - 11}"])  # cursor 10, not 20
    result = once_twice_never(trained_counts(storage), [f"s{i}" for i in range(30)], 1)
    assert result[0] == {"once": 10, "twice_or_more": 10, "never": 10, "other": 0}
