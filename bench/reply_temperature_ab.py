"""Replies at the serving temperature: the demo trained on greedy replies against replies sampled at T=1 (and any other
arms), the same training steps each, τ in vLLM at T=0 and T=1 for each.

    python bench/reply_temperature_ab.py [--arms 0 1 1:0.95] [--max-steps 1100] [--out /tmp/ab41] [key=value ...]

An arm is `TEMPERATURE[:TOP_P]` (`train.replies.temperature`, `train.replies.top_p`); the first is the baseline. Each
arm is the whole demo pipeline (`jobs/pipeline.py --recipe demo`: replies, training, export, evaluation) into a run
folder of its own under --out, one after the other; the prepared data is shared (the second arm's prepare finds it
done). An arm whose stages are recorded as done is not run again, so a failed command resumes; an arm's time is its
stages' recorded seconds. The latency sweep is skipped (`eval.concurrency=[]`). `train.schedule.max_steps` gives
every arm the same steps: arms whose replies differ in length pack into different step counts over the same epochs.
Extra `key=value` overrides go to every arm.

The goal (issue 41): τ at T=1 ≥ 3.4, and τ at T=0 at most 0.05 below the baseline's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def arm_name(arm: str) -> str:
    temperature, _, top_p = arm.partition(":")
    return f"t{temperature}" + (f"_p{top_p}" if top_p else "")


def label(arm: str) -> str:
    temperature, _, top_p = arm.partition(":")
    return f"replies T={temperature}" + (f" top_p={top_p}" if top_p else "")


def run_arm(arm: str, out: Path, max_steps: int, overrides: list[str]) -> dict:
    temperature, _, top_p = arm.partition(":")
    name = f"demo_{arm_name(arm)}".replace(".", "")
    train = out / arm_name(arm) / "train"
    command = [
        sys.executable,
        "jobs/pipeline.py",
        "--recipe",
        "demo",
        f"name={name}",
        f"data.output={out / 'prepared'}",
        f"train.output={train}",
        f"train.states.cache={out / arm_name(arm) / 'cache'}",
        f"train.replies.temperature={temperature}",
        f"train.replies.top_p={top_p or 1.0}",
        f"train.schedule.max_steps={max_steps}",
        "eval.concurrency=[]",
        *overrides,
    ]
    print(f"[ab] {label(arm)}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    doc = json.loads((train / "eval" / name / "eval.json").read_text())
    records = {p.stem: json.loads(p.read_text()) for p in (train / "pipeline" / name).glob("*.json")}
    stage = {s: records[s]["summary"] for s in ("replies", "train")}
    print(f"[ab] {label(arm)}: {time.perf_counter() - start:.0f} s in this run", flush=True)
    return {
        "arm": arm,
        "seconds": round(sum(r["seconds"] for r in records.values())),  # stages done in an earlier run count too
        "steps": stage["train"]["step"],
        "reply_tokens": stage["replies"]["tokens"] / max(stage["replies"]["replies"], 1),
        "tau": {g["temperature"]: g["tau"] for g in doc["vllm"]},
        "train": str(train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms", nargs="+", default=["0", "1"], help="TEMPERATURE[:TOP_P] per arm; the first: baseline"
    )
    parser.add_argument("--max-steps", type=int, default=1100, help="train.schedule.max_steps of every arm")
    parser.add_argument("--out", default="/tmp/ab41", help="run folders, one per arm, and the shared prepared data")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every arm")
    args = parser.parse_args()
    out = Path(args.out)
    results = [run_arm(arm, out, args.max_steps, args.overrides) for arm in args.arms]
    base = results[0]
    figures = []
    for r in results:
        print(json.dumps(r), flush=True)
        for t, tau in sorted(r["tau"].items()):
            goal = {"at_least": 3.4} if t == 1.0 and r is not base else {}
            figures.append(figure(f"{label(r['arm'])}: τ in vLLM, T={t:g}", tau, **goal))
        if r is not base:
            figures.append(
                figure(
                    f"{label(r['arm'])}: τ in vLLM at T=0 lost against {label(base['arm'])}",
                    base["tau"][0.0] - r["tau"][0.0],
                    at_most=0.05,
                )
            )
        figures.append(figure(f"{label(r['arm'])}: training steps", r["steps"]))
        figures.append(figure(f"{label(r['arm'])}: mean reply", r["reply_tokens"], "tokens"))
        figures.append(
            figure(
                f"{label(r['arm'])}: the arm's stages (prepare, replies, training, export, evaluation)",
                r["seconds"],
                "s",
            )
        )
    record("reply_temperature_ab", figures)


if __name__ == "__main__":
    main()
