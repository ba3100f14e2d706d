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


def test_the_step_of_a_drafter_with_its_draft_vocabulary_is_timed_beside_the_whole_vocabulary(tiny_target: str) -> None:
    import torch

    from raypipe.config import ServeConfig, TrainConfig
    from raypipe.eval.offline import step_seconds
    from raypipe.eval.report import draft_vocab_summary
    from raypipe.target import resolve_target
    from raypipe.train.drafter import build_drafter
    from raypipe.train.vocab import vocab_from_counts

    target = resolve_target(ServeConfig(model=tiny_target, num_gpus=0, resource=None, kv_cache_gib=1))
    counts = np.zeros(target.shape.vocab_size, np.int64)
    counts[100:400] = np.arange(300, 0, -1)
    vocab = vocab_from_counts(counts, 256)
    tc = TrainConfig(
        output="unused", drafter={"draft_layers": 1, "block_size": 4, "draft_vocab_size": 256}, run={"use_gpu": False}
    )
    drafters = {
        "draft_vocab": build_drafter(target, tc, vocab).eval(),
        "full_vocab": build_drafter(
            target, tc.model_copy(update={"drafter": tc.drafter.model_copy(update={"draft_vocab_size": None})}), None
        ).eval(),
    }
    assert drafters["full_vocab"].lm_head.weight.shape[0] == target.shape.vocab_size
    states = torch.randn(20, len(target.layer_ids), target.shape.hidden_size)
    seconds = step_seconds(drafters, [(list(range(100, 120)), states, 6)], repeats=2)

    # Replies: 3 of 4 tokens at T=0 are in the draft vocabulary (ids 100-355), none at T=1.
    doc = draft_vocab_summary(vocab.t2d.numpy(), {1.0: [[5, 6]], 0.0: [[100, 101], [355, 356]]}, seconds)
    assert doc["size"] == 256 and doc["target_vocab_size"] == target.shape.vocab_size
    assert doc["reply_tokens_in_vocab"] == [{"temperature": 0.0, "share": 0.75}, {"temperature": 1.0, "share": 0.0}]
    assert set(doc["drafter_step_ms"]) == {"draft_vocab", "full_vocab"} and min(seconds.values()) > 0
    assert doc["full_over_draft"] == seconds["full_vocab"] / seconds["draft_vocab"]
