"""A drafter step with the target's whole vocabulary against a draft vocabulary (`train.draft_vocab_size`), side by
side in one process.

    python bench/draft_vocab.py [--draft-vocab-size 8192] [--steps 10]

The target is `builtin:tiny_qwen36` (Qwen3.6's architecture and its 248,320-token
vocabulary, hidden size 64): the LM head's share of a step is what a draft
vocabulary removes, and it grows with the vocabulary over the hidden size, so
this shape shows more of it than a 4,096-wide Qwen3.6-27B would. Both drafters:
1 layer, block 4, kl_div, a 2,900-token pack of 4 rows, 32 anchors, one thread,
raypipe's HEAP_ENV; the draft vocabulary is the most frequent supervised tokens
of the pack (raypipe.train.vocab). Steps alternate between the two after one
warm-up step each, so that the machine's noise falls on both. Prints each arm's
mean step time and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from raypipe.heap import HEAP_ENV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in HEAP_ENV.items()):  # glibc reads them at start: run again with them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HEAP_ENV, "OMP_NUM_THREADS": "1"})

    import numpy as np
    import torch

    from raypipe.config import ServeConfig, TrainConfig
    from raypipe.target import resolve_target
    from raypipe.train.anchors import anchor_count, install_row_anchors
    from raypipe.train.batches import drafter_inputs, pack_host
    from raypipe.train.drafter import build_drafter, step_kwargs
    from raypipe.train.rows import Row
    from raypipe.train.vocab import vocab_from_counts

    torch.set_num_threads(1)
    target = resolve_target(ServeConfig(model="builtin:tiny_qwen36", num_gpus=0, resource=None, kv_cache_gib=1))
    vocab_size = target.shape.vocab_size
    rng = np.random.default_rng(0)
    common = rng.integers(0, vocab_size, 20_000)  # the tokens the rows draw from, a few far more often than others
    rows = [
        Row(f"r{i}", common[rng.zipf(1.3, n) % len(common)], np.r_[np.zeros(20), np.ones(n - 20)].astype(np.int64))
        for i, n in enumerate((700, 500, 900, 800))
    ]
    counts = sum(np.bincount(r.input_ids[r.loss_mask == 1], minlength=vocab_size) for r in rows)
    states = [torch.randn(len(r.input_ids), len(target.layer_ids), target.shape.hidden_size) for r in rows]
    batch = drafter_inputs(pack_host(rows, states, pin=False), torch.float32)

    arms = {}
    for name, size in (("full vocabulary", None), (f"draft vocabulary {args.draft_vocab_size}", args.draft_vocab_size)):
        tc = TrainConfig(
            output="unused",
            draft_layers=1,
            block_size=4,
            max_pack_anchors=32,
            step_tokens=3072,
            use_gpu=False,
            seed=0,
            loss="kl_div",
            position_weighting="exp_decay",
            loss_decay_gamma=2.0,
            draft_vocab_size=size,
        )
        drafter = build_drafter(target, tc, vocab_from_counts(counts, size) if size else None)
        install_row_anchors(drafter, tc.max_anchors)
        optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
        count = anchor_count([r.loss_mask for r in rows], tc.max_anchors, tc.max_pack_anchors, tc.block_size)
        arms[name] = (drafter, optimizer, tc, count, [])

    def step(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, tc: TrainConfig, count: int) -> float:
        start = time.perf_counter()
        _, loss, _ = drafter(**batch, **step_kwargs(tc), max_anchors=count)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for drafter, optimizer, tc, count, _ in arms.values():
        step(drafter, optimizer, tc, count)  # warm-up
    for _ in range(args.steps):
        for drafter, optimizer, tc, count, times in arms.values():
            times.append(step(drafter, optimizer, tc, count))
    means = {name: sum(a[4]) / len(a[4]) for name, a in arms.items()}
    full, reduced = means.values()
    kept = vocab_from_counts(counts, args.draft_vocab_size).t2d.numpy()
    print(
        json.dumps(
            {
                "target_vocab_size": vocab_size,
                "step_s": {k: round(v, 4) for k, v in means.items()},
                "supervised_tokens_covered": round(float(counts[kept].sum() / counts.sum()), 4),
                "full_over_reduced": round(full / reduced, 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
