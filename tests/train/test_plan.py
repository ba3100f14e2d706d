"""The epoch plan: deterministic, a permutation of every row, packs within budget, exact resume on any world size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.train.plan import epoch_order, lr_factor, pack_rows, plan_epoch


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
