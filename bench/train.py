"""The training loop under Ray Train against a plain torch loop, and online extraction against its parts.

    python bench/train.py --rows 400 --steps 60

One run, on the same prepared rows (the bundled sample's first rows), drafter
(debug_cpu recipe) and packs, with the real vLLM service on the tiny target:
1. fill: a Ray Train run in hybrid mode stores the states of the packs (and
   the on-policy replies) in a local cache;
2. Ray Train, 1 worker, offline (states from the cache);
3. a plain single-process torch loop, offline, same packs, same thread count;
4. Ray Train, 1 worker, online (states from the service, 4 steps in flight);
5. extraction alone: the same packs through the client, 4 in flight, no training.
The engine runs on core 0 and everything else (the Train worker, the plain
loop) on core 1, one thread each, so extraction and training overlap instead of
sharing a core. Steady state: the first --warmup steps of each are left out. Prints tokens/s
of 2 and 3 and their ratio (target >= 0.95), the online step time against
max(extraction time, compute time) (target <= 1.1) and the online wait fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

OUT = Path(__file__).parent / "out" / "train_bench"
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample"


def steady(steps: list[dict], warmup: int) -> dict[str, float]:
    """Totals over the logged intervals after `warmup` steps (the runs log every step: train.run.log_every=1)."""
    kept = [s for s in steps if s["step"] > warmup]
    n = sum(s.get("steps", 1) for s in kept)
    step_s = sum(s["step_s"] for s in kept)
    wait_s = sum(s["wait_s"] for s in kept)
    tokens = sum(s["tokens"] for s in kept)
    return {
        "steps": n,
        "tokens_per_s": tokens / step_s,
        "step_s": step_s / n,
        "compute_s": (step_s - wait_s) / n,
        "wait_fraction": wait_s / step_s,
    }


def first_epoch(cfg):
    """The run's rows (replies loaded) and its first epoch's plan, as the trainers see them."""
    from raypipe.train.plan import plan_epoch
    from raypipe.train.replies import open_rows

    tc = cfg.train
    rows = open_rows(cfg)
    rows.load_replies()
    plan = plan_epoch(
        rows.shard_sizes,
        rows.lengths(),
        seed=tc.schedule.seed,
        epoch=0,
        window=tc.schedule.shuffle_window,
        budget=tc.schedule.step_tokens,
    )
    return rows, plan


def plain_loop(cfg, steps: int) -> list[dict]:
    """The same work as one Ray Train worker, in this process, without Ray."""
    import torch

    from raypipe.storage import Storage
    from raypipe.target import resolve_target
    from raypipe.train.anchors import anchor_count, install_row_anchors
    from raypipe.train.batches import drafter_inputs, pack_host
    from raypipe.train.drafter import build_drafter
    from raypipe.train.states import StateCache, stream_states
    from raypipe.train.step import TrainState, precision, train_step

    tc = cfg.train
    target = resolve_target(cfg.serve)
    rows, plan = first_epoch(cfg)
    model = build_drafter(target, tc, None)
    install_row_anchors(model, tc.objective.max_anchors)
    state = TrainState.create(model, model, tc, torch.device("cpu"), steps)  # one process: the drafter unwrapped
    cache = StateCache(Storage(tc.states.cache, {}), cfg.serve, list(target.layer_ids))
    dtype = precision(torch.device("cpu"))[1]
    packs = [[rows.row(int(i)) for i in plan.packs[s]] for s in range(steps)]
    torch.manual_seed(tc.schedule.seed * 1_000_003)
    out = []
    tick = time.perf_counter()
    for step, (pack, states) in enumerate(
        zip(packs, stream_states(([r.input_ids for r in p] for p in packs), "offline", None, cache), strict=True), 1
    ):
        waited = time.perf_counter() - tick
        batch = drafter_inputs(pack_host(pack, states, pin=False), dtype)
        anchors = anchor_count(
            [r.loss_mask for r in pack], tc.objective.max_anchors, tc.objective.max_pack_anchors, tc.drafter.block_size
        )
        train_step(state, batch, anchors)
        out.append(
            {
                "step": step,
                "tokens": float(batch["input_ids"].shape[1]),
                "wait_s": waited,
                "step_s": time.perf_counter() - tick,
            }
        )
        tick = time.perf_counter()
    return out


def extraction_alone(cfg, handle, steps: int) -> float:
    """Seconds per pack when the service only extracts (4 requests in flight, as the trainer asks)."""
    from raypipe.serve.client import HiddenStateClient

    tc = cfg.train
    rows, plan = first_epoch(cfg)
    batches = [[rows.row(int(i)).input_ids.tolist() for i in plan.packs[s]] for s in range(steps)]
    client = HiddenStateClient(handle, max_in_flight=tc.states.prefetch)
    list(client.stream(batches[:4]))  # warm-up
    start = time.perf_counter()
    for _ in client.stream(batches):
        pass
    return (time.perf_counter() - start) / len(batches)


def _on_core_1() -> None:
    """Ray's worker_process_setup_hook: a worker runs on core 1 (vLLM's engine threads bind themselves to core 0)."""
    import torch

    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", type=int, default=400, help="Raw rows from the bundled sample (60%% openai, 40%% sharegpt)."
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    import ray
    import torch
    from ray import serve

    from raypipe.config import load_config
    from raypipe.data.pipeline import run_prepare
    from raypipe.layout import RunFolders
    from raypipe.serve.deployment import APP_NAME, build_app
    from raypipe.train.launcher import latest_checkpoint, run_training
    from raypipe.train.ledger import read_training_curve
    from raypipe.train.replies import run_replies

    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "src").mkdir(parents=True)
    for name, share in (("openai", 0.6), ("sharegpt", 0.4)):
        lines = (SAMPLE / name / "part-00000.jsonl").read_text().splitlines()[: round(args.rows * share)]
        (OUT / "src" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")

    def config(name: str, mode: str):
        return load_config(
            "debug_cpu",
            [
                f"name={name}",
                f"data.sources=[{{path: {OUT}/src/*.jsonl}}]",
                f"data.output={OUT}/prepared",
                "data.max_length=512",
                "serve.max_model_len=1024",
                f"train.output={OUT}/run",
                f"train.states.cache={OUT}/cache",
                f"train.states.mode={mode}",
                "train.schedule.step_tokens=512",
                "train.objective.max_anchors=16",
                "train.replies.max_tokens=16",
                "train.run.num_workers=1",
                f"train.schedule.max_steps={args.steps}",
                "train.schedule.epochs=1",
                "train.run.checkpoint_every=1000000",
                "train.run.log_every=1",
            ],
        )

    # The engine and the trainer on separate cores: vLLM binds its compute threads to core 0, every other
    # process (Ray workers, so the Train worker; this driver, for the plain loop) runs on core 1, one thread each.
    os.sched_setaffinity(0, {1})
    runtime_env = {
        "worker_process_setup_hook": _on_core_1,
        "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"},
    }
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", runtime_env=runtime_env)
    run_prepare(config("fill", "hybrid").data)
    handle = serve.run(build_app(config("fill", "hybrid").serve), name=APP_NAME, route_prefix=None)

    def ray_train(name: str, mode: str) -> tuple[list[dict], float, int]:
        cfg = config(name, mode)
        start = time.perf_counter()
        run_replies(cfg)
        assert run_training(cfg).error is None
        wall = time.perf_counter() - start
        steps = read_training_curve(RunFolders.of(cfg).ledger)
        threads = latest_checkpoint(cfg).read_json("provenance.json")["torch_threads"]
        return steps, wall, threads

    ray_train("fill", "hybrid")
    offline_steps, offline_wall, threads = ray_train("offline", "offline")
    torch.set_num_threads(threads)  # the same intra-op threads as the Ray Train worker
    plain = steady(plain_loop(config("plain", "offline"), args.steps), args.warmup)
    offline = steady(offline_steps, args.warmup)
    online_steps, online_wall, _ = ray_train("online", "online")
    online = steady(online_steps, args.warmup)
    extract_s = extraction_alone(config("online", "online"), handle, args.steps)
    serve.delete(APP_NAME)
    ray.shutdown()

    bound = max(extract_s, offline["compute_s"])
    report = {
        "steps_measured": offline["steps"],
        "torch_threads": threads,
        "ray_train_offline_tokens_per_s": round(offline["tokens_per_s"], 1),
        "plain_loop_tokens_per_s": round(plain["tokens_per_s"], 1),
        "ray_train_over_plain": round(offline["tokens_per_s"] / plain["tokens_per_s"], 3),
        "online_step_s": round(online["step_s"], 4),
        "extraction_alone_s_per_step": round(extract_s, 4),
        "compute_s_per_step": round(offline["compute_s"], 4),
        "online_over_max_extract_compute": round(online["step_s"] / bound, 3),
        "online_wait_fraction": round(online["wait_fraction"], 4),
        "ray_train_fit_wall_s": {"offline": round(offline_wall, 1), "online": round(online_wall, 1)},
    }
    print(json.dumps(report, indent=1))
    record(
        "train",
        [
            figure("online step over max(extraction, compute)", online["step_s"] / bound, "x", at_most=1.1),
            figure(
                "Ray Train offline over the plain loop, tokens/s",
                offline["tokens_per_s"] / plain["tokens_per_s"],
                "x",
                at_least=0.95,
            ),
            figure("online trainer's wait for states", 100 * online["wait_fraction"], "%"),
        ],
    )


if __name__ == "__main__":
    main()
