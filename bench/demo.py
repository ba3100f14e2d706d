"""The README's main command, measured: wall time, peak memory of its process tree, τ.

    python bench/demo.py [--fresh]      # --fresh removes runs/demo and the cached demo target first

Memory is the sum of the resident set sizes of every process the command
starts (driver, Ray's daemons and workers, vLLM engines), sampled every half
second; shared pages count once per process, so it is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(p: psutil.Process) -> int:
    total = 0
    for proc in [p, *p.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fresh", action="store_true", help="start from nothing: no runs/demo, no cached demo target")
    args = parser.parse_args()
    if args.fresh:
        from raypipe.assets.qwen_vocab import cache_root

        shutil.rmtree(ROOT / "runs" / "demo", ignore_errors=True)
        shutil.rmtree(cache_root() / "models" / "demo_target", ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "jobs/pipeline.py", "--recipe", "demo"], cwd=ROOT)
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(watched))
        time.sleep(0.5)
    wall = time.perf_counter() - start
    doc = json.loads((ROOT / "runs/demo/train/eval/eval.json").read_text())
    stages = {
        p.stem: round(json.loads(p.read_text())["seconds"])
        for p in sorted((ROOT / "runs/demo/train/pipeline").glob("*.json"))
    }
    print(
        json.dumps(
            {
                "exit_code": proc.returncode,
                "wall_s": round(wall),
                "peak_rss_gib": round(peak / 2**30, 2),
                "stage_s": stages,
                "tau": round(doc["tau"], 3),
                "offline_tau": round(doc["offline_replay"]["tau"], 3),
                "untrained_tau": round(doc["vllm_untrained_drafter"]["tau"], 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
