"""The offline replay walks vLLM's greedy verification loop."""

from __future__ import annotations

import numpy as np

from raypipe.eval.offline import walk


def test_a_perfect_drafter_accepts_whole_blocks_even_past_the_end() -> None:
    replay = walk(np.full(40, 3), start=9, end=39, width=3)  # 29 tokens to generate after the anchor at 9
    # 7 full blocks of 3 + bonus reach 37; the 8th block is verified whole, like vLLM, though 1 token is left.
    assert replay.steps == 8 and replay.accepted == 24
    assert replay.accepted_per_position == [8, 8, 8]
    assert replay.tau == 1 + 24 / 8


def test_a_useless_drafter_verifies_one_token_per_step() -> None:
    replay = walk(np.zeros(20, dtype=int), start=4, end=20, width=3)
    assert replay.steps == 15 and replay.accepted == 0 and replay.tau == 1.0


def test_the_walk_jumps_over_accepted_tokens() -> None:
    accepted = np.zeros(12, dtype=int)
    accepted[[2, 5]] = [2, 1]  # from 2 accept 2 (next anchor 5), from 5 accept 1 (next anchor 7)
    replay = walk(accepted, start=2, end=10, width=3)
    assert replay.steps == 4 and replay.accepted == 3 and replay.accepted_per_position == [2, 1, 0]
