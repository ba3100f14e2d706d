"""The README's main command, measured: wall time, peak memory of its process tree, the target's build, τ.

    python bench/demo.py [--recipe demo|demo_qwen36] [--fresh]   # --fresh removes runs/RECIPE and its cached target

`--recipe demo_qwen36` runs the same demo on Qwen3.6's architecture (builtin:demo_qwen36): run both, one after the
other, to compare their τ on the same machine.

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
import threading
import time
from pathlib import Path

import psutil
from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(p: psutil.Process) -> int:
    total = 0
    for proc in [p, *p.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def sample_rss(watched: psutil.Process, peaks: list[int]) -> None:
    while watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE:
        peaks[0] = max(peaks[0], tree_rss(watched))
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="demo", choices=["demo", "demo_qwen36"])
    parser.add_argument("--fresh", action="store_true", help="start from nothing: no runs/RECIPE, no cached target")
    args = parser.parse_args()
    runs = ROOT / "runs" / args.recipe
    if args.fresh:
        from raypipe.assets.qwen_vocab import cache_root

        shutil.rmtree(runs, ignore_errors=True)
        shutil.rmtree(cache_root() / "models" / f"{args.recipe}_target", ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "jobs/pipeline.py", "--recipe", args.recipe], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    watched = psutil.Process(proc.pid)
    peaks = [0]
    sampler = threading.Thread(target=sample_rss, args=(watched, peaks), daemon=True)
    sampler.start()
    build_start = build_s = None
    for line in proc.stdout:  # the job's output, passed on; the target's build runs from its notice to the replies
        print(line, end="", flush=True)
        if build_start is None and "not built yet" in line:
            build_start = time.perf_counter()
        elif build_start is not None and build_s is None and "[replies]" in line:
            build_s = round(time.perf_counter() - build_start)
    proc.wait()
    wall = time.perf_counter() - start
    doc = json.loads((runs / "train" / "eval" / args.recipe / "eval.json").read_text())
    stages = {
        p.stem: round(json.loads(p.read_text())["seconds"])
        for p in sorted((runs / "train" / "pipeline" / args.recipe).glob("*.json"))
    }
    figures = [
        figure(
            "whole command" + (" (the target's build included)" if build_s else " (target cached)"), round(wall), "s"
        )
    ]
    if build_s:
        figures.append(figure("the target's build", build_s, "s"))
    figures += [figure(f"τ in vLLM, T={g['temperature']:g}", g["tau"]) for g in doc["vllm"]]
    if doc["latency"]:  # None when the evaluation's latency sweep was skipped
        figures += [
            figure("time per output token without the drafter over with, concurrency 1", s["tpot"], "x")
            for s in doc["latency"]["speedup"]
            if s["concurrency"] == 1
        ]
    figures += [
        figure("τ, untrained drafter", doc["vllm_untrained_drafter"]["tau"]),
        figure("peak memory, sum of RSS over the process tree", peaks[0] / 2**30, "GiB"),
    ]
    if proc.returncode == 0:
        record(args.recipe, figures)
    print(
        json.dumps(
            {
                "exit_code": proc.returncode,
                "wall_s": round(wall),
                "recipe": args.recipe,
                "peak_rss_gib": round(peaks[0] / 2**30, 2),
                "target_build_s": build_s,  # None: the target was built before
                "stage_s": stages,
                "tau": round(doc["tau"], 3),
                "tau_by_temperature": {g["temperature"]: round(g["tau"], 3) for g in doc["vllm"]},
                "offline_tau": round(doc["offline_replay"]["tau"], 3),
                "untrained_tau": round(doc["vllm_untrained_drafter"]["tau"], 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
