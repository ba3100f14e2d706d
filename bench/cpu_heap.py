"""A drafter step and an engine's extractions on CPU with glibc's default malloc thresholds against raypipe's
HEAP_ENV (raypipe.heap): the same work, side by side in one run.

    python bench/cpu_heap.py [--steps 10]

Each arm runs in its own process, one thread:
- step: the debug_cpu drafter shape on the tiny Qwen3 target (1 layer,
  block 4, kl_div, a 2,900-token pack of 4 rows, 32 anchors): forward,
  backward, AdamW, `--steps` times after one warm-up step;
- engine: bench/engine_cpu.py's work (the real VllmEngine, 1,500
  extractions and 128 replies).
Prints per arm the step's wall time, user and system seconds and minor page
faults, the engine's work CPU and the step's peak memory, then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

from raypipe.heap import HEAP_ENV

ROOT = Path(__file__).resolve().parents[1]


def debug_drafter_step(target: Any, rows: list[Any], vocab: Any = None) -> Callable[[], None]:
    """One optimizer step of the debug_cpu drafter shape (1 layer, block 4, kl_div, 32 anchors) on `rows` packed with
    random states; `vocab` (raypipe.train.vocab.DraftVocab) gives the drafter a draft vocabulary. bench/draft_vocab.py
    times it too."""
    import torch

    from raypipe.config import TrainConfig
    from raypipe.train.anchors import anchor_count, install_row_anchors
    from raypipe.train.batches import drafter_inputs, pack_host
    from raypipe.train.drafter import build_drafter, step_kwargs

    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 1, "block_size": 4, "draft_vocab_size": vocab.size if vocab is not None else None},
        objective={
            "max_pack_anchors": 32,
            "loss": "kl_div",
            "position_weighting": "exp_decay",
            "loss_decay_gamma": 2.0,
        },
        schedule={"step_tokens": 3072, "seed": 0},
        run={"use_gpu": False},
    )
    drafter = build_drafter(target, tc, vocab)
    install_row_anchors(drafter, tc.objective.max_anchors)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    states = [torch.randn(len(r.input_ids), len(target.layer_ids), target.shape.hidden_size) for r in rows]
    batch = drafter_inputs(pack_host(rows, states, pin=False), torch.float32)
    count = anchor_count(
        [r.loss_mask for r in rows], tc.objective.max_anchors, tc.objective.max_pack_anchors, tc.drafter.block_size
    )

    def step() -> None:
        _, loss, _ = drafter(**batch, **step_kwargs(tc), max_anchors=count)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def step_arm(model: str, steps: int) -> dict:
    import numpy as np

    from raypipe.config import ServeConfig
    from raypipe.target import resolve_target
    from raypipe.train.rows import Row

    target = resolve_target(ServeConfig(model=model, num_gpus=0, resource=None, kv_cache_gib=1))
    rng = np.random.default_rng(0)
    rows = [
        Row(
            f"r{i}", rng.integers(0, 150_000, n).astype(np.int64), np.r_[np.zeros(20), np.ones(n - 20)].astype(np.int64)
        )
        for i, n in enumerate((700, 500, 900, 800))
    ]
    step = debug_drafter_step(target, rows)
    step()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "step_s": round((time.perf_counter() - start) / steps, 3),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "sys_s": round(after.ru_stime - before.ru_stime, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "peak_rss_mib": after.ru_maxrss // 1024,
    }


def run(args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-arm", help=argparse.SUPPRESS)  # the model path, in the arm's own process
    args = parser.parse_args()
    if args.step_arm:
        print(json.dumps(step_arm(args.step_arm, args.steps)), flush=True)
        return

    from raypipe.assets.tiny_target import build_tiny_target

    model = str(build_tiny_target(Path(tempfile.mkdtemp()) / "tiny_target"))
    results = {}
    for name, env in (("glibc defaults", {}), ("HEAP_ENV", HEAP_ENV)):
        step = run([__file__, "--step-arm", model, "--steps", str(args.steps)], env)
        engine = run(
            ["bench/engine_cpu.py", "--arm", "one-process", "--model", model],
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env},
        )
        results[name] = {"step": step, "engine_work_cpu_s": engine["work_cpu_s"]}
        print(json.dumps({"arm": name, **results[name]}), flush=True)
    old, new = results["glibc defaults"], results["HEAP_ENV"]
    record(
        "cpu_heap",
        [
            figure("drafter step, glibc defaults over HEAP_ENV", old["step"]["step_s"] / new["step"]["step_s"], "x"),
            figure(
                "engine work CPU, glibc defaults over HEAP_ENV",
                old["engine_work_cpu_s"] / new["engine_work_cpu_s"],
                "x",
            ),
            figure("drafter step with HEAP_ENV", new["step"]["step_s"], "s"),
        ],
    )
    print(
        json.dumps(
            {
                "step_time_ratio_defaults_over_heap_env": round(old["step"]["step_s"] / new["step"]["step_s"], 2),
                "engine_cpu_ratio_defaults_over_heap_env": round(
                    old["engine_work_cpu_s"] / new["engine_work_cpu_s"], 2
                ),
                "peak_rss_ratio_heap_env_over_defaults": round(
                    new["step"]["peak_rss_mib"] / old["step"]["peak_rss_mib"], 2
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
