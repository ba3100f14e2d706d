"""τ in vLLM during training on the demo (issue 41): its curve and cost, and the fail-fast rule on a broken contract.

    python bench/tau_in_training.py --out /tmp/tau41

Arms, one after another, each in its own process and local Ray instance, on the demo recipe with the same prepared
data (the first arm prepares it):
- `off`: eval.every_steps unset (checkpoints ranked by training loss), then export and the evaluation;
- `on`: the demo's eval.every_steps (checkpoints ranked by τ in vLLM), then export and the evaluation;
- two broken serving contracts that no static check sees (the drafter's config.json is right), made in the trainers
  by a Ray worker setup hook, up to 600 steps: `layers`, the target's layers in reverse order; `rotary`, the
  drafter's attention rotated in the interleaved (GPT-J) layout where vLLM rotates halves (NeoX). The fail-fast
  rule should stop them within their first measurements.
The training stage's wall time (the hidden-state service's start included in both) compares `off` with `on`, and
within `on`, the seconds training waited for τ (the engine's start included) with the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]


def reverse_target_layers() -> None:
    """Worker setup hook of the `broken` arm: each packed step's auxiliary layers reversed before the drafter sees
    them."""
    import raypipe.train.batches as batches

    pack = batches.pack_host

    def reversed_layers(rows, states, pin):  # noqa: ANN001, ANN202 - the wrapped function's own signature
        packed = pack(rows, states, pin)
        packed["hidden"][:, :-1] = packed["hidden"][:, :-1].flip(1).clone()
        return packed

    batches.pack_host = reversed_layers


def interleaved_rotary() -> None:
    """Worker setup hook of the `rotary` arm: speculators' DFlash attention rotates pairs of adjacent dimensions."""
    import torch
    from speculators.models.dflash import model_definitions

    def rotate_pairs(x):  # noqa: ANN001, ANN202 - the replaced function's own signature
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

    model_definitions._rotate_half = rotate_pairs


BROKEN = {"layers": reverse_target_layers, "rotary": interleaved_rotary}
ARMS = ("off", "on", *BROKEN)


def run_arm(arm: str, out: Path) -> dict:
    import ray

    from raypipe.config import load_config
    from raypipe.layout import RunFolders
    from raypipe.pipeline import eval_stage, prepare_stage, replies_stage, train_stage
    from raypipe.train.export import export_drafter, tau_curve
    from raypipe.train.ledger import read_training_curve
    from raypipe.train.tau_rule import TauTooLow

    overrides = [
        f"data.output={out / 'prepared'}",
        f"train.output={out / arm / 'train'}",
        f"train.states.cache={out / arm / 'cache'}",
        "eval.concurrency=[]",
        "eval.k_concurrency=[]",
    ]
    if arm == "off":
        overrides.append("eval.every_steps=null")
    if arm in BROKEN:
        overrides.append("train.schedule.max_steps=600")
    cfg = load_config("demo", overrides)
    hook = BROKEN.get(arm)
    ray.init(address="local", num_cpus=2, runtime_env={"worker_process_setup_hook": hook} if hook else None)
    prepare_stage(cfg)
    replies_stage(cfg)
    start = time.perf_counter()
    doc: dict = {"arm": arm, "every_steps": cfg.eval.every_steps}
    try:
        trained = train_stage(cfg)
        doc["train_s"] = time.perf_counter() - start
        doc["step"] = trained.step
    except (TauTooLow, RuntimeError) as err:
        doc.update(train_s=time.perf_counter() - start, stopped=str(err))
        return doc
    if arm in BROKEN:  # not stopped: its curve
        doc["tau_curve"] = tau_curve(RunFolders.of(cfg).ledger)
        return doc
    export = export_drafter(cfg)
    curve = read_training_curve(RunFolders.of(cfg).ledger)
    doc.update(
        measure_s=sum(s.get("vllm_tau_seconds", 0.0) for s in curve),
        exported_step=export["training_state"]["step"],
        chosen_by=export["chosen_by"],
        tau_curve=export["tau_curve"],
    )
    evaluated = eval_stage(cfg)
    doc["tau"] = evaluated.tau
    doc["tau_by_temperature"] = {
        g["temperature"]: g["tau"] for g in json.loads(Path(evaluated.output, "eval.json").read_text())["vllm"]
    }
    return doc


def arm_result(out: Path, arm: str) -> dict:
    """An arm's result, from the last line its process printed, with the probe's start time from its log."""
    text = (out / f"{arm}.log").read_text()
    lines = [line for line in text.splitlines() if line.startswith("ARM ")]
    if not lines:
        raise SystemExit(f"arm {arm} failed: see {out / f'{arm}.log'}")
    doc = json.loads(lines[-1][4:])
    started = re.search(r"engine started in ([0-9.]+) s", text)
    doc["probe_start_s"] = float(started.group(1)) if started else None
    return doc


def broken_figures(name: str, doc: dict) -> list[dict]:
    """Whether the rule stopped a broken arm, where, and its τ in vLLM against the training estimate."""
    out = [figure(f"{name}: stopped by the fail-fast rule", int("stopped" in doc))]
    if "stopped" in doc:
        step = int(re.search(r"at step (\d+)", doc["stopped"]).group(1))
        tau = float(re.search(r"τ in vLLM is ([0-9.]+)", doc["stopped"]).group(1))
        return [*out, figure(f"{name}: stopped at step", step), figure(f"{name}: τ in vLLM when stopped, T=0", tau)]
    last = doc["tau_curve"][-1]
    return [*out, figure(f"{name}: τ in vLLM at step {last['step']} (not stopped), T=0", last["tau"]["0"])]


def summarize(out: Path) -> None:
    off, on = arm_result(out, "off"), arm_result(out, "on")
    broken = {arm: arm_result(out, arm) for arm in BROKEN if (out / f"{arm}.log").exists()}
    first = on["tau_curve"][0]
    waited = on["measure_s"] + on["probe_start_s"]
    figures = [
        figure(
            "training stage, τ measured during training over not", on["train_s"] / off["train_s"], "x", at_most=1.15
        ),
        figure(
            "training's wait for τ (engine start included) over the rest, same run",
            waited / (on["train_s"] - waited),
            "x",
            at_most=0.15,
        ),
        figure("measurements during training", len(on["tau_curve"])),
        figure(f"τ in vLLM at the first measurement (step {first['step']}), T=0", first["tau"]["0"]),
        figure("τ in vLLM, exported checkpoint ranked by τ, T=0", on["tau_by_temperature"]["0.0"]),
        figure("τ in vLLM, exported checkpoint ranked by loss, T=0", off["tau_by_temperature"]["0.0"]),
        figure("τ in vLLM, exported checkpoint ranked by τ, T=1", on["tau_by_temperature"]["1.0"]),
        figure("τ in vLLM, exported checkpoint ranked by loss, T=1", off["tau_by_temperature"]["1.0"]),
    ]
    names = {"layers": "layers in reverse order", "rotary": "interleaved rotary"}
    for arm, doc in broken.items():
        figures += broken_figures(names[arm], doc)
    record("tau_in_training", figures)
    print(json.dumps({"figures": figures, "arms": {"off": off, "on": on, **broken}}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/tau41"))
    parser.add_argument("--arm", choices=ARMS, help="run one arm in this process (internal)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run (default all)")
    parser.add_argument("--summarize", action="store_true", help="only read the arms' logs under --out and record")
    args = parser.parse_args()
    if args.arm:
        print("ARM " + json.dumps(run_arm(args.arm, args.out)), flush=True)
        return
    if not args.summarize:
        args.out.mkdir(parents=True, exist_ok=True)
        for arm in args.arms:
            with (args.out / f"{arm}.log").open("w") as log:  # the arm's whole output
                subprocess.run(
                    [sys.executable, __file__, "--arm", arm, "--out", str(args.out)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "RAY_ADDRESS": "local"},
                )
    summarize(args.out)


if __name__ == "__main__":
    main()
