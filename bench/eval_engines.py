"""The evaluation's engines on CPU in one process (raypipe.eval.evaluate.EngineHosts) against one process each, as
before: side by side in one run, on the demo target and an untrained drafter of the demo recipe's shape.

    python bench/eval_engines.py [--engines 5]

Arm "one process": `--engines` engines in a row in one interpreter, with a
drafter and without in turn, each generating for 8 prompts; the process's RSS
is read after each. Arm "a process each": the same engines, each in a new
interpreter (as a fresh Ray worker imports vLLM). Prints one JSON line per arm
and the ratio of wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def engines(count: int, drafter: str, start: int) -> list[dict]:
    """`count` engines in this process, the drafter on the even ones counting from `start`; each one's seconds and the
    RSS after it."""
    import gc

    import psutil

    from raypipe.config import load_config
    from raypipe.eval.spec_decode import generate_in_vllm
    from raypipe.serve.vllm_args import engine_args
    from raypipe.target import resolve_target

    cfg = load_config("demo", [])
    args = engine_args(resolve_target(cfg.serve), cfg.serve)
    out = []
    for i in range(count):
        began = time.perf_counter()
        with_drafter = drafter if (start + i) % 2 == 0 else None
        [run] = generate_in_vllm(args, with_drafter, 3, [[1, 2, 3, 4, 5, 6]] * 8, [0.0], max_tokens=16)
        gc.collect()
        out.append(
            {
                "seconds": round(time.perf_counter() - began, 2),
                "drafts": run.drafts,
                "rss_gib": round(psutil.Process().memory_info().rss / 2**30, 3),
            }
        )
    return out


def untrained_drafter(directory: str) -> str:
    from raypipe.config import load_config
    from raypipe.target import resolve_target
    from raypipe.train.drafter import build_drafter

    cfg = load_config("demo", [])
    build_drafter(resolve_target(cfg.serve), cfg.train, None).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=5)
    parser.add_argument("--arm", choices=["one", "each"], help=argparse.SUPPRESS)
    parser.add_argument("--drafter", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(engines(args.count, args.drafter, args.start)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        drafter = untrained_drafter(tmp)

        def child(count: int, start: int) -> list[dict]:
            cmd = [sys.executable, __file__, "--arm", "one", "--count", str(count), "--drafter", drafter]
            cmd += ["--start", str(start)]
            out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            return json.loads(out.strip().splitlines()[-1])

        start = time.perf_counter()
        one = child(args.engines, 0)
        one_s = time.perf_counter() - start
        start = time.perf_counter()
        each = [child(1, i)[0] for i in range(args.engines)]
        each_s = time.perf_counter() - start
    print(json.dumps({"arm": "one process", "wall_s": round(one_s, 1), "engines": one}))
    print(json.dumps({"arm": "a process each", "wall_s": round(each_s, 1), "engines": each}))
    print(json.dumps({"a_process_each_over_one_process": round(each_s / one_s, 2)}))
    record(
        "eval_engines",
        [figure("wall, a process each over one process", each_s / one_s, "x"), figure("wall, one process", one_s, "s")],
    )


if __name__ == "__main__":
    main()
