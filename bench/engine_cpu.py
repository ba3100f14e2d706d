"""The CPU a service engine takes on CPU, with vLLM's multiprocess executor (its default there) against the
one-process executor raypipe selects (ENGINE_ENV, raypipe.serve.vllm_args): the same requests, side by side in one run.

    python bench/engine_cpu.py [--sequences 1500]

Each arm runs in its own process: the real VllmEngine on the tiny Qwen3
target (bfloat16, 3 layers extracted), `--sequences` extractions of 50-400
tokens all in flight, then 128 greedy replies of 32 tokens. It prints one JSON
line per arm (start and work wall time, the CPU the engine's processes used
during the work) and the ratio of work CPU, multiprocess over one-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def engine_cpu_s() -> float:
    """User + system seconds of this process and its live children (the engine core, and the worker if any)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def arm(sequences: int, model: str) -> dict:
    from raypipe.config import ServeConfig
    from raypipe.serve.engine import Sampling
    from raypipe.serve.transport import discard, replica_dir
    from raypipe.serve.vllm_engine import VllmEngine
    from raypipe.target import resolve_target

    cfg = ServeConfig.model_validate(
        {
            "model": model,
            "layer_ids": [1, 2, 4],
            "dtype": "bfloat16",
            "max_model_len": 512,
            "num_gpus": 0,
            "resource": None,
            "kv_cache_gib": 1,
            "enforce_eager": True,
        }
    )
    rng = random.Random(0)
    seqs = [[rng.randrange(100, 150_000) for _ in range(rng.randrange(50, 400))] for _ in range(sequences)]
    greedy = Sampling(temperature=0.0, top_p=1.0, max_tokens=32, seed=0, stop_token_ids=())
    loop = asyncio.new_event_loop()
    start = time.perf_counter()

    async def started() -> VllmEngine:
        return VllmEngine(resolve_target(cfg), cfg, replica_dir())

    engine = loop.run_until_complete(started())
    ready, cpu = time.perf_counter(), engine_cpu_s()

    async def work() -> None:
        for path in await asyncio.gather(*(engine.extract(s) for s in seqs)):
            discard(path)
        await asyncio.gather(*(engine.generate(s[:64], greedy) for s in seqs[:128]))

    loop.run_until_complete(work())
    done, used = time.perf_counter(), engine_cpu_s() - cpu
    engine.close()
    return {"start_s": round(ready - start, 1), "work_s": round(done - ready, 1), "work_cpu_s": round(used, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1500)
    parser.add_argument("--arm", choices=["multiprocess", "one-process"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps({"arm": args.arm, **arm(args.sequences, args.model)}), flush=True)
        return

    from raypipe.assets.tiny_target import build_tiny_target

    model = str(build_tiny_target(Path(tempfile.mkdtemp()) / "tiny_target"))
    results = {}
    for name, flag in (("multiprocess", "1"), ("one-process", "0")):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": flag, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--arm", name, "--sequences", str(args.sequences), "--model", model]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(results[name]), flush=True)
    ratio = results["multiprocess"]["work_cpu_s"] / results["one-process"]["work_cpu_s"]
    print(json.dumps({"work_cpu_ratio_multiprocess_over_one_process": round(ratio, 2)}))
    one = results["one-process"]
    record(
        "engine_cpu",
        [
            figure("work CPU, multiprocess over one process", ratio, "x"),
            figure("work CPU, one process", one["work_cpu_s"], "s"),
            figure("engine start, one process", one["start_s"], "s"),
        ],
    )


if __name__ == "__main__":
    main()
