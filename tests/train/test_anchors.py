"""Anchors per row with a cap per pack, in speculators' real DFlash drafter; the loss settings it is given."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raypipe.config import LOSSES, TrainConfig
from raypipe.target import resolve_target
from raypipe.train.anchors import anchor_count, install_row_anchors, row_anchor_mask
from raypipe.train.batches import drafter_inputs, pack_host
from raypipe.train.drafter import build_drafter, step_kwargs
from raypipe.train.rows import Row
from tests.helpers import serve_config

BLOCK = 4


def masks(*rows: str) -> list[np.ndarray]:
    """Loss masks written as strings: '0011' is two prompt then two supervised positions."""
    return [np.array([int(c) for c in r], dtype=np.int64) for r in rows]


def test_anchor_count_caps_each_row_then_the_pack_and_skips_the_packs_last_block() -> None:
    rows = masks("0011111111", "00111", "0111111")  # 8, 3 and 6 supervised positions
    # The pack's last 4 positions (all in the third row) are never anchors: 8 + 3 + 2.
    assert anchor_count(rows, per_row=100, per_pack=100, block_size=BLOCK) == 13
    assert anchor_count(rows, per_row=3, per_pack=100, block_size=BLOCK) == 3 + 3 + 2
    assert anchor_count(rows, per_row=3, per_pack=5, block_size=BLOCK) == 5
    # A last row shorter than the block: the exclusion reaches into the row before.
    assert anchor_count(masks("1111111", "11"), per_row=100, per_pack=100, block_size=BLOCK) == 5
    assert anchor_count(masks("0000"), per_row=8, per_pack=8, block_size=BLOCK) == 1  # an empty anchor, masked out


def pack(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    loss_mask = torch.from_numpy(np.concatenate(rows)).unsqueeze(0)
    document_ids = torch.from_numpy(np.concatenate([np.full(len(m), i) for i, m in enumerate(rows)])).unsqueeze(0)
    return loss_mask, document_ids


@pytest.mark.parametrize("seed", range(5))
def test_row_anchor_mask_draws_up_to_per_row_supervised_positions_of_each_row_and_exactly_the_count(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [(rng.random(int(rng.integers(8, 60))) < 0.6).astype(np.int64) for _ in range(5)]
    loss_mask, document_ids = pack(rows)
    torch.manual_seed(seed)
    for per_row, per_pack in ((4, 1000), (10, 1000), (10, 17), (1000, 1000)):
        count = anchor_count(rows, per_row, per_pack, BLOCK)
        chosen = row_anchor_mask(loss_mask, document_ids, per_row, count, BLOCK)[0]
        assert int(chosen.sum()) == count
        assert not (chosen & ~loss_mask[0].bool()).any() and not chosen[-BLOCK:].any()
        per_doc = torch.bincount(document_ids[0][chosen], minlength=len(rows))
        assert (per_doc <= per_row).all()
        if per_pack == 1000:  # no cap: every row gets min(per_row, its supervised positions)
            valid = loss_mask[0].bool().clone()
            valid[-BLOCK:] = False
            available = torch.bincount(document_ids[0][valid], minlength=len(rows))
            assert torch.equal(per_doc, torch.clamp(available, max=per_row))


def test_a_pack_cap_alone_samples_uniformly_over_the_pack_as_speculators_does() -> None:
    """max_anchors above every row's length and a pack cap: the old per-pack draw (each position equally likely)."""
    rows = masks("1" * 40, "1" * 10)
    loss_mask, document_ids = pack(rows)
    torch.manual_seed(0)
    hits = torch.zeros(50)
    for _ in range(2000):
        hits += row_anchor_mask(loss_mask, document_ids, 10_000, 10, BLOCK)[0].float()
    valid = hits[:-BLOCK]
    assert (hits[-BLOCK:] == 0).all() and valid.min() > 0.6 * valid.mean() and valid.max() < 1.4 * valid.mean()


@pytest.fixture(scope="module")
def drafter_and_target(tiny_target: str):
    target = resolve_target(serve_config(tiny_target))
    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 1, "block_size": BLOCK},
        objective={"max_anchors": 3},
        schedule={"step_tokens": 256, "seed": 0},
        run={"use_gpu": False},
    )
    drafter = build_drafter(target, tc, None)
    install_row_anchors(drafter, tc.objective.max_anchors)
    return drafter, target, tc


def test_the_drafter_anchors_each_row_of_a_pack_and_trains_on_them(drafter_and_target) -> None:
    drafter, target, tc = drafter_and_target
    rng = np.random.default_rng(0)
    rows = [
        Row(f"r{i}", rng.integers(0, 150_000, n).astype(np.int64), np.r_[np.zeros(4), np.ones(n - 4)].astype(np.int64))
        for i, n in enumerate((40, 12, 30))
    ]
    states = [torch.randn(len(r.input_ids), len(target.layer_ids), target.shape.hidden_size) for r in rows]
    batch = drafter_inputs(pack_host(rows, states, pin=False), torch.float32)
    count = anchor_count([r.loss_mask for r in rows], tc.objective.max_anchors, tc.objective.max_pack_anchors, BLOCK)
    assert count == 9  # 3 per row: speculators' per-pack draw would give the longest row the most
    torch.manual_seed(1)
    _, _, anchors, valid = drafter._build_attention_mask(  # noqa: SLF001 - the selection the forward uses
        batch["loss_mask"], count, batch["document_ids"], torch.device("cpu")
    )
    assert valid.all() and torch.bincount(batch["document_ids"][0][anchors], minlength=3).tolist() == [3, 3, 3]
    _, loss, metrics = drafter(**batch, **step_kwargs(tc), max_anchors=count)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters() if p.requires_grad)


def test_loss_settings_follow_speculators_defaults_and_refuse_dpace_without_ce() -> None:
    tc = TrainConfig(output="unused")
    assert (tc.objective.loss, tc.objective.position_weighting, tc.objective.dpace_alpha) == ("ce", "dpace", 0.5)
    kwargs = step_kwargs(TrainConfig(output="unused", run={"use_gpu": False}))
    assert list(kwargs["loss_config"]) == ["ce"] and kwargs["per_position_loss_weight"] == "dpace"
    mix = step_kwargs(
        TrainConfig(
            output="unused",
            objective={"loss": {"ce": 0.1, "tv": 0.9}, "position_weighting": "exp_decay"},
            run={"use_gpu": False},
        )
    )
    assert {k: w for k, (_, w) in mix["loss_config"].items()} == {"ce": 0.1, "tv": 0.9}
    assert mix["per_position_loss_weight"] == "fixed-exp-decay"
    with pytest.raises(ValueError, match="needs train.objective.loss=ce"):
        TrainConfig(output="unused", objective={"loss": "kl_div"})
    with pytest.raises(ValueError, match="unknown loss"):
        TrainConfig(output="unused", objective={"loss": {"ce": 1.0, "hinge": 1.0}, "position_weighting": "exp_decay"})


def test_every_loss_name_the_config_accepts_is_one_speculators_resolves() -> None:
    from speculators.losses import resolve_loss_config

    for name in LOSSES:
        assert list(resolve_loss_config(name, "eager")) == [name]
    assert list(resolve_loss_config(json.dumps(dict.fromkeys(LOSSES, 1.0)), "eager")) == list(LOSSES)
