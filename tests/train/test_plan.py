"""The epoch plan: deterministic, a permutation of every row, packs within budget, exact resume on any world size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.train.plan import epoch_order, lr_factor, pack_rows, plan_epoch, total_steps


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
    window=st.integers(1, 5),
    budget=st.integers(30, 200),
)
def test_plan_covers_every_row_once_within_budget(
    sizes: list[int], seed: int, epoch: int, window: int, budget: int
) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 31, size=sum(sizes))
    plan = plan_epoch(sizes, lengths, seed=seed, epoch=epoch, window=window, budget=budget)
    rows = np.concatenate(plan.packs) if plan.packs else np.zeros(0, np.int64)
    assert sorted(rows.tolist()) == list(range(sum(sizes)))
    assert all(lengths[p].sum() <= budget and len(p) > 0 for p in plan.packs)
    again = plan_epoch(sizes, lengths, seed=seed, epoch=epoch, window=window, budget=budget)
    assert [p.tolist() for p in again.packs] == [p.tolist() for p in plan.packs]


def test_windows_keep_rows_of_few_shards_together() -> None:
    sizes = [10] * 8
    order = epoch_order(sizes, seed=0, epoch=0, window=2)
    for start in range(0, 80, 20):  # each window of 2 shards is 20 consecutive positions of the order
        assert len({int(r) // 10 for r in order[start : start + 20]}) == 2


def test_epochs_differ_and_seed_changes_order() -> None:
    sizes = [50, 50]
    assert epoch_order(sizes, 0, 0, 2).tolist() != epoch_order(sizes, 0, 1, 2).tolist()
    assert epoch_order(sizes, 0, 0, 2).tolist() != epoch_order(sizes, 1, 0, 2).tolist()


@pytest.mark.parametrize("first_world,second_world", [(2, 2), (2, 3), (4, 1)])
def test_resume_at_cursor_trains_each_pack_once(first_world: int, second_world: int) -> None:
    lengths = np.full(37, 10)
    plan = plan_epoch([37], lengths, seed=3, epoch=0, window=1, budget=20)  # 19 packs
    trained: list[int] = []
    cursor = 0
    for step in range(4):  # the first group trains 4 steps, then "fails" after its checkpoint
        trained += [i for r in range(first_world) if (i := plan.pack_index(0, step, r, first_world)) is not None]
        cursor = min(cursor + first_world, len(plan.packs))
    for step in range(plan.steps(second_world, cursor)):
        trained += [i for r in range(second_world) if (i := plan.pack_index(cursor, step, r, second_world)) is not None]
    assert sorted(trained) == list(range(len(plan.packs)))


def test_row_over_budget_names_the_fix() -> None:
    with pytest.raises(ValueError, match="train.schedule.step_tokens"):
        pack_rows(np.arange(2), np.array([5, 50]), budget=20)


def test_lr_warms_up_then_decays_to_zero() -> None:
    total = 100
    factors = [lr_factor(s, total, 0.04) for s in range(total + 1)]
    assert factors[0] == pytest.approx(0.25) and factors[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert factors[total] == pytest.approx(0.0)


def _replay(plans: list, world: int, epoch: int, cursor: int, done: int, stop_after: int | None) -> tuple:
    """The training loop's arithmetic (raypipe.train.loop.Trainer.run) from a checkpoint's progress: the packs each
    epoch trains, stopping after `stop_after` steps (a checkpoint) or at the end; returns them and the progress."""
    total = total_steps(plans, world, epoch, cursor, done, None)
    trained: dict[int, list[int]] = {p.epoch: [] for p in plans}
    step = done
    while epoch < len(plans) and step < total:
        plan = plans[epoch]
        for _ in range(min(plan.steps(world, cursor), total - step)):
            trained[epoch] += [i for r in range(world) if (i := plan.pack_index(cursor, 0, r, world)) is not None]
            cursor, step = min(cursor + world, len(plan.packs)), step + 1
            if stop_after is not None and step - done == stop_after:
                return trained, (epoch, cursor, step)
        epoch, cursor = epoch + 1, 0
    return trained, (epoch, cursor, step)


@pytest.mark.parametrize("first,second,stop_after", [(2, 4, 50), (2, 4, 24), (2, 1, 26), (4, 2, 13), (1, 3, 70)])
def test_a_resume_on_another_world_size_trains_every_pack_of_every_epoch_once(first, second, stop_after) -> None:
    """Issue 40: the run's length was recomputed for the new world size and compared with a step count of the old
    one. 2 epochs x 100 packs, checkpointed after epoch 0 on 2 workers and resumed on 4, ended at once; resumed
    mid-epoch, 52 of 200 packs were never trained."""
    lengths = np.full(100, 10)
    plans = [plan_epoch([100], lengths, seed=1, epoch=e, window=1, budget=10) for e in range(2)]  # 100 packs each
    before, (epoch, cursor, step) = _replay(plans, first, 0, 0, 0, stop_after)
    after, end = _replay(plans, second, epoch, cursor, step, None)
    for e in range(2):
        assert sorted(before[e] + after[e]) == list(range(100)), f"epoch {e}"
    assert end[2] == total_steps(plans, second, epoch, cursor, step, None)  # the schedule's length is where it ends
