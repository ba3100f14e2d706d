"""speculators 0.9.0's private DFlashDraftModel methods, as raypipe.compat.speculators calls them, on a drafter of the
tiny target."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from raypipe.compat.speculators import block_logits, select_anchors_with
from raypipe.config import TrainConfig
from raypipe.target import resolve_target
from raypipe.train.drafter import aux_layer_ids, build_drafter, drafter_config
from tests.helpers import serve_config

BLOCK = 4
T = 24  # positions of the test sequence


@pytest.fixture(scope="module")
def target_and_config(tiny_target: str) -> tuple[Any, TrainConfig]:
    target = resolve_target(serve_config(tiny_target))
    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 1, "block_size": BLOCK, "mask_token_id": 7},
        schedule={"step_tokens": 256, "seed": 0},
        run={"use_gpu": False},
    )
    return target, tc


def test_every_setting_passed_to_build_base_config_kwargs_reaches_the_config(target_and_config) -> None:
    target, tc = target_and_config
    config = drafter_config(target, tc)  # raypipe.compat.speculators.build_base_config_kwargs, then the config
    assert (config.block_size, config.mask_token_id, config.sliding_window_non_causal) == (BLOCK, 7, True)
    assert config.aux_hidden_state_layer_ids == aux_layer_ids(list(target.layer_ids), target.shape.num_layers)
    assert config.draft_vocab_size == target.shape.vocab_size
    assert config.transformer_layer_config._attn_implementation == "sdpa"  # noqa: SLF001 - train.run's CPU choice
    assert config.speculators_config.verifier.name_or_path == target.path


def inputs(target: Any, anchors: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    hidden = target.shape.hidden_size
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1
    return {
        "hidden_states": torch.randn(1, T, (len(target.layer_ids) - 1) * hidden),
        "input_ids": torch.randint(0, 1000, (1, T)),
        "loss_mask": loss_mask,
        "verifier_last_hidden_states": torch.randn(1, T, hidden),
        "document_ids": torch.zeros(1, T, dtype=torch.long),
        "max_anchors": len(anchors),
    }


def test_the_anchors_are_exactly_the_chosen_positions(target_and_config) -> None:
    target, tc = target_and_config
    drafter = build_drafter(target, tc, None)
    chosen = torch.zeros(1, T, dtype=torch.bool)
    chosen[0, [3, 9, 15]] = True
    seen: list[tuple[int, int]] = []

    def choose(loss_mask: torch.Tensor, document_ids: torch.Tensor, max_anchors: int) -> torch.Tensor:
        seen.append((int(loss_mask.sum()), max_anchors))
        return chosen

    select_anchors_with(drafter, choose)
    everywhere = torch.ones(1, T, dtype=torch.long)
    for _ in range(3):  # speculators draws at random from the mask; the chosen mask leaves it no choice
        _, _, anchors, valid = drafter._build_attention_mask(everywhere, 3, torch.zeros(1, T), torch.device("cpu"))  # noqa: SLF001
        assert anchors.tolist() == [3, 9, 15] and valid.all()
    assert seen == [(T, 3)] * 3  # choose sees the full loss mask and the count


def test_block_logits_are_one_block_per_anchor_in_anchor_order(target_and_config) -> None:
    target, tc = target_and_config
    drafter = build_drafter(target, tc, None).eval()
    with torch.no_grad():
        both = block_logits(drafter, **inputs(target, [5, 12]))
        first = block_logits(drafter, **inputs(target, [5]))
        second = block_logits(drafter, **inputs(target, [12]))
    assert both.shape == (1, 2 * BLOCK, target.shape.vocab_size)
    # A block attends to the context before its anchor and to itself only, so each block equals its anchor alone.
    torch.testing.assert_close(both[:, :BLOCK], first, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[:, BLOCK:], second, atol=1e-4, rtol=1e-4)
