"""Replies at the serving temperature: the demo trained on greedy replies against replies sampled at T=1 (and any other
arms), the same training steps each, τ in vLLM at T=0 and T=1 for each.

    python bench/reply_temperature_ab.py [--arms 0 1 1:0.9] [--seeds 0 1] [--max-steps 1000] [--out /tmp/ab41] [k=v ...]

An arm is `TEMPERATURE[:TOP_P]` (`train.replies.temperature`, `train.replies.top_p`); the first is the baseline. Each
arm is the whole demo pipeline (`jobs/pipeline.py --recipe demo`: replies, training, export, evaluation) into a run
folder of its own under --out, one after the other; the prepared data is shared (the second arm's prepare finds it
done). An arm whose stages are recorded as done is not run again, so a failed command resumes; an arm's time is its
stages' recorded seconds. The latency sweep is skipped (`eval.concurrency=[]`). `train.schedule.max_steps` gives
every arm the same steps: arms whose replies differ in length pack into different step counts over the same epochs.
Each arm runs once per `--seeds` value (`train.schedule.seed`: data order, anchors, initialisation and the sampled
replies), so the differences can be read against the spread between seeds. Extra `key=value` overrides go to every
arm.

The goal (issue 41): τ at T=1 ≥ 3.4, and τ at T=0 at most 0.05 below the baseline's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def arm_name(arm: str) -> str:
    temperature, _, top_p = arm.partition(":")
    return f"t{temperature}" + (f"_p{top_p}" if top_p else "")


def label(arm: str) -> str:
    temperature, _, top_p = arm.partition(":")
    return f"replies T={temperature}" + (f" top_p={top_p}" if top_p else "")


def run_arm(arm: str, seed: int, out: Path, max_steps: int, overrides: list[str]) -> dict:
    temperature, _, top_p = arm.partition(":")
    folder = arm_name(arm) + (f"_s{seed}" if seed else "")  # seed 0, the recipe's: no suffix
    name = f"demo_{folder}".replace(".", "")
    train = out / folder / "train"
    command = [
        sys.executable,
        "jobs/pipeline.py",
        "--recipe",
        "demo",
        f"name={name}",
        f"data.output={out / 'prepared'}",
        f"train.output={train}",
        f"train.states.cache={out / folder / 'cache'}",
        f"train.replies.temperature={temperature}",
        f"train.replies.top_p={top_p or 1.0}",
        f"train.schedule.seed={seed}",
        f"train.schedule.max_steps={max_steps}",
        "eval.concurrency=[]",
        *overrides,
    ]
    print(f"[ab] {label(arm)}, seed {seed}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    doc = json.loads((train / "eval" / name / "eval.json").read_text())
    records = {p.stem: json.loads(p.read_text()) for p in (train / "pipeline" / name).glob("*.json")}
    stage = {s: records[s]["summary"] for s in ("replies", "train")}
    print(f"[ab] {label(arm)}, seed {seed}: {time.perf_counter() - start:.0f} s in this run", flush=True)
    return {
        "arm": arm,
        "seed": seed,
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
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="train.schedule.seed: each arm runs once per seed"
    )
    parser.add_argument("--max-steps", type=int, default=1000, help="train.schedule.max_steps of every arm")
    parser.add_argument("--out", default="/tmp/ab41", help="run folders, one per arm, and the shared prepared data")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every arm")
    args = parser.parse_args()
    out = Path(args.out)
    runs = {arm: [run_arm(arm, seed, out, args.max_steps, args.overrides) for seed in args.seeds] for arm in args.arms}
    base = args.arms[0]

    def mean_tau(arm: str, t: float) -> float:
        return float(np.mean([r["tau"][t] for r in runs[arm]]))

    steps = {r["steps"] for rs in runs.values() for r in rs}
    assert len(steps) == 1, f"every run trains the same steps (train.schedule.max_steps), got {steps}"
    figures = []
    for arm, rs in runs.items():
        for r in rs:
            print(json.dumps(r), flush=True)
            figures += [
                figure(f"{label(arm)}, seed {r['seed']}: τ in vLLM, T={t:g}", tau) for t, tau in r["tau"].items()
            ]
        seeds = f"mean of {len(rs)} seeds" if len(rs) > 1 else f"seed {rs[0]['seed']}"
        for t in sorted(rs[0]["tau"]):
            goal = {"at_least": 3.4} if t == 1.0 and arm != base else {}
            figures.append(figure(f"{label(arm)}: τ in vLLM, T={t:g}, {seeds}", mean_tau(arm, t), **goal))
        if arm != base:
            lost = mean_tau(base, 0.0) - mean_tau(arm, 0.0)
            figures.append(figure(f"{label(arm)}: τ at T=0 lost against {label(base)}, {seeds}", lost, at_most=0.05))
        figures.append(figure(f"{label(arm)}: training steps, each seed", rs[0]["steps"]))
        figures.append(figure(f"{label(arm)}: mean reply", float(np.mean([r["reply_tokens"] for r in rs])), "tokens"))
        figures.append(
            figure(
                f"{label(arm)}: the arm's stages (prepare, replies, training, export, evaluation), per seed",
                round(float(np.mean([r["seconds"] for r in rs]))),
                "s",
            )
        )
    record("reply_temperature_ab", figures)


if __name__ == "__main__":
    main()
