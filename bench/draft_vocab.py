"""A drafter step with the target's whole vocabulary against a draft vocabulary
(`train.drafter.draft_vocab_size`), side by side in one process.

    python bench/draft_vocab.py [--draft-vocab-size 8192] [--steps 10]

The target is `builtin:tiny_qwen36` (Qwen3.6's architecture and its 248,320-token
vocabulary, hidden size 64): the LM head's share of a step is what a draft
vocabulary removes, and it grows with the vocabulary over the hidden size, so
this shape shows more of it than a 4,096-wide Qwen3.6-27B would. Both drafters:
bench/cpu_heap.py's debug_cpu step (1 layer, block 4, kl_div, a 2,900-token pack
of 4 rows, 32 anchors), one thread, raypipe's HEAP_ENV; the draft vocabulary is the most frequent supervised tokens
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
from collections.abc import Callable

from cpu_heap import debug_drafter_step  # bench/ is on sys.path when this runs as a script
from figures import figure, record  # bench/ is on sys.path when this runs as a script

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

    from raypipe.config import ServeConfig
    from raypipe.target import resolve_target
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
    vocab = vocab_from_counts(counts, args.draft_vocab_size)
    arms = {
        "full vocabulary": (debug_drafter_step(target, rows), []),
        f"draft vocabulary {args.draft_vocab_size}": (debug_drafter_step(target, rows, vocab), []),
    }

    def timed(step: Callable[[], None]) -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    for step, _ in arms.values():
        step()  # warm-up
    for _ in range(args.steps):
        for step, times in arms.values():
            times.append(timed(step))
    means = {name: sum(times) / len(times) for name, (_, times) in arms.items()}
    full, reduced = means.values()
    kept = vocab.t2d.numpy()
    record(
        "draft_vocab",
        [
            figure(f"step, full vocabulary ({vocab_size:,})", full, "s"),
            figure(f"step, draft vocabulary {args.draft_vocab_size:,}", reduced, "s"),
            figure("full over draft vocabulary", full / reduced, "x"),
        ],
    )
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
