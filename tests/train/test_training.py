"""The training stage end to end: Ray Train workers (gloo, CPU) fed online by the real vLLM service."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import ray
from ray.train import TrainingFailedError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from raypipe.eval.prompts import load_prompts
from raypipe.eval.spec_decode import generate_in_vllm
from raypipe.layout import RunFolders
from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.transport import reclaim_orphans
from raypipe.serve.vllm_args import ENGINE_ENV, engine_args
from raypipe.storage import Storage
from raypipe.target import resolve_target
from raypipe.train.export import export_drafter, tau_curve
from raypipe.train.launcher import run_training
from raypipe.train.ledger import read_ledger, read_training_curve
from raypipe.train.replies import run_replies
from raypipe.train.tau_rule import TauTooLow
from tests.helpers import scrape_metrics
from tests.train.helpers import run_config, with_replies

pytestmark = pytest.mark.integration


def train(cfg):
    """As `raypipe train` does: the reply pass (with the `replies` fixture's copy, nothing left to do), then the
    workers."""
    run_replies(cfg)
    return run_training(cfg)


def train_while(cfg, strike: Callable[[], dict | None]) -> tuple[Any, dict]:
    """Train while a thread calls `strike` every 0.2 s (up to 600 s) until it returns what it did; returns (result,
    that)."""
    struck: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not struck:
            struck.update(strike() or {})
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    result = train(cfg)
    watcher.join()
    return result, struck


def test_two_workers_train_online_the_loss_falls_and_vllm_drafts_with_the_export(
    memory_heavy: None, ray_cluster: str, prepared: Path, replies, service, tmp_path: Path
) -> None:
    """Also τ in vLLM during training (issue 41): measured every 25 steps and at each checkpoint by a warm engine
    whose drafter is reloaded in place, equal to a fresh engine's τ for the same weights, recorded with every
    interval's metrics, ranking the checkpoints, and what export takes. (The tiny target is random, so τ stays near 1:
    eval.min_tau=1 keeps the fail-fast rule out of this run.)"""
    cfg = with_replies(
        run_config(
            prepared,
            tmp_path,
            "train.schedule.max_steps=100",  # the loss ratio is 0.52 at 100 steps with the 4,096-token draft vocabulary
            "train.schedule.epochs=20",
            "train.run.checkpoint_every=50",
            "train.run.log_every=5",
            "train.run.trackers=[tensorboard]",
            "eval.every_steps=25",
            "eval.num_prompts=4",  # the sample's 5th prompt is longer than this max_model_len
            "eval.probe_prompts=4",
            "eval.min_tau=1.0",
        ),
        replies,
    )
    result = train(cfg)
    assert result.error is None
    steps = read_training_curve(RunFolders.of(cfg).ledger)
    # One reduction per 5 steps, and at each checkpoint (every 50 steps and each epoch's end); every step in one
    # interval.
    assert (
        steps[-1]["step"] == 100 and sum(s["steps"] for s in steps) == 100 and all(0 < s["steps"] <= 5 for s in steps)
    )
    # τ in vLLM at every 25th step and at every checkpoint, at both eval temperatures; each checkpoint scored by it.
    curve = tau_curve(RunFolders.of(cfg).ledger)
    measured = {c["step"]: c["tau"] for c in curve}
    checkpoints = {int(m["step"]): m for _, m in result.best_checkpoints}
    assert {25, 50, 75, 100} <= set(measured) and set(checkpoints) <= set(measured), (measured, checkpoints)
    assert all(set(t) == {"0", "1"} and all(v >= 1 for v in t.values()) for t in measured.values())
    assert all(m["vllm_tau"] == measured[s]["0"] for s, m in checkpoints.items())
    first = sum(s["loss"] for s in steps[:4]) / 4
    last = sum(s["loss"] for s in steps[-4:]) / 4
    print(json.dumps({"first_loss": first, "last_loss": last, "last": steps[-1]}))
    assert last < 0.7 * first, (first, last)
    assert all(0 <= s["wait_fraction"] <= 1 and s["tokens_per_s"] > 0 for s in steps)
    names = [
        f"ray_raypipe_train_{m}"
        for m in ("loss", "tau_estimate", "wait_fraction", "lr", "tokens_per_s", "steps_total", "accuracy", "vllm_tau")
    ]
    exported = scrape_metrics(ray_cluster, names)
    assert all(exported.values()), f"not exported: {[n for n, v in exported.items() if not v]}"
    # TensorBoard got the same intervals from rank 0.
    events = EventAccumulator(RunFolders.of(cfg).tensorboard.url, size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s["step"], pytest.approx(s["loss"])) for s in steps]
    assert [(e.step, e.value) for e in events.Scalars("vllm_tau/t0")] == [
        (s, pytest.approx(t["0"])) for s, t in sorted(measured.items())
    ]
    # Every needs_response row got an on-policy reply, stored once for later epochs.
    stored = sum(pq.read_table(str(p)).num_rows for p in (Path(cfg.train.output) / "replies").glob("*.parquet"))
    manifest = json.loads((Path(cfg.data.output) / "manifest.json").read_text())
    assert stored == manifest["counts"]["needs_response"]

    # The export loads in vLLM as a DFlash drafter; speculative decoding runs and stays lossless (greedy, fp32).
    export = export_drafter(cfg)
    assert export["speculative_config"]["num_speculative_tokens"] == cfg.train.drafter.block_size - 1
    # Export takes the kept checkpoint of the highest τ (the later on a tie) and records the curve.
    assert export["chosen_by"] == "vllm_tau" and export["tau_curve"] == curve
    best = max(checkpoints.values(), key=lambda m: (m["vllm_tau"], m["step"]))
    assert export["training_state"]["step"] == best["step"]
    target = export["provenance"]["target_path"]
    prompts = [list(range(1000 + 40 * i, 1030 + 40 * i)) for i in range(4)]
    run_in_vllm = ray.remote(num_cpus=0.5, runtime_env={"env_vars": ENGINE_ENV})(generate_in_vllm)
    fp32 = cfg.serve.model_copy(update={"dtype": "float32"})  # the reference below is fp32: compare like with like
    engine = engine_args(resolve_target(fp32), fp32)
    [greedy] = ray.get(
        run_in_vllm.remote(
            engine,
            export["speculative_config"]["model"],
            cfg.train.drafter.block_size - 1,
            prompts,
            [0.0],
            max_tokens=24,
        )
    )
    print(json.dumps(greedy.summary()))
    assert greedy.drafts > 0 and greedy.draft_tokens == greedy.drafts * (cfg.train.drafter.block_size - 1)
    assert len(greedy.accepted_per_position) == cfg.train.drafter.block_size - 1
    assert greedy.replies == TransformersEngine(target, (4,)).generate(prompts, Sampling(max_tokens=24))
    # The warm engine measured what a fresh engine with the exported weights measures: the reload is complete.
    probe_prompts = load_prompts(cfg)[1][: cfg.eval.probe_prompts]
    [fresh] = ray.get(
        run_in_vllm.remote(
            engine_args(resolve_target(cfg.serve), cfg.serve),
            export["speculative_config"]["model"],
            cfg.train.drafter.block_size - 1,
            probe_prompts,
            [0.0],
            max_tokens=cfg.eval.max_tokens,
        )
    )
    assert fresh.tau == pytest.approx(measured[best["step"]]["0"], abs=1e-6), (fresh.summary(), measured)


def test_tau_in_vllm_below_min_tau_stops_the_run_at_the_patience_th_measurement_and_its_restarts_at_once(
    memory_heavy: None, prepared: Path, replies, service, tmp_path: Path
) -> None:
    """Issue 41: τ below eval.min_tau once measured eval.patience times stops the run with a message that points at
    the serving contract; Ray Train's restart of the group stops at its start instead of training again."""
    cfg = with_replies(
        run_config(
            prepared,
            tmp_path,
            "train.schedule.max_steps=60",
            "train.schedule.epochs=20",
            "train.run.checkpoint_every=50",
            "train.run.max_failures=1",
            "eval.every_steps=10",
            "eval.num_prompts=4",
            "eval.temperatures=[0.0]",
            "eval.min_tau=5",
            "eval.patience=2",
        ),
        replies,
    )
    with pytest.raises(TauTooLow, match=r"at step 20, after 2 measurements .*eval\.min_tau 5\.00.*serving contract"):
        train(cfg)
    steps = RunFolders.of(cfg).steps
    lines = [json.loads(line) for rel in steps.glob("*.jsonl") for line in steps.read(rel).decode().splitlines()]
    attempts = {line["attempt"] for line in lines if "attempt" in line}
    assert len(attempts) == 2, "Ray Train restarts the group once (train.run.max_failures=1)"
    assert max(line.get("step", 0) for line in lines) == 20, "the run went on after the stop, or its restart trained"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _all_sample_ids(cfg) -> list[str]:
    return [
        sid
        for f in sorted(Path(cfg.data.output, "data").glob("*.parquet"))
        for sid in pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()
    ]


def test_a_killed_worker_resumes_from_its_checkpoint_and_trains_every_sample_once(
    prepared: Path, replies, service, tmp_path: Path
) -> None:
    cfg = with_replies(
        run_config(
            prepared, tmp_path, "train.schedule.epochs=1", "train.run.checkpoint_every=8", "train.run.max_failures=2"
        ),
        replies,
    )
    run = RunFolders.of(cfg)

    def kill_a_worker_after_a_committed_checkpoint() -> dict | None:
        # A second ledger segment means the first checkpoint was reported (report() is a barrier before training goes
        # on); Ray Train's controller registers it a moment later, in its checkpoint manager's snapshot: a group
        # killed before that restarts from the previous checkpoint.
        segments = run.ledger.glob("epoch-0000/*.rank-0001.json") if run.root.exists("ledger") else []
        if len(segments) < 2 or not run.ray_train.exists(f"{cfg.name}/checkpoint_manager_snapshot.json"):
            return None
        first, second = run.ledger.read_json(segments[0]), run.ledger.read_json(segments[1])
        os.kill(second["pid"], signal.SIGKILL)
        return {"pid": second["pid"], "committed": first["packs"][1], "cursor": second["packs"][1]}

    result, killed = train_while(cfg, kill_a_worker_after_a_committed_checkpoint)
    assert result.error is None and killed
    expected = Counter(_all_sample_ids(cfg))
    assert max(expected.values()) == 1
    for epoch in range(cfg.train.schedule.epochs):
        segments = read_ledger(run.ledger, epoch)
        trained = Counter(sid for seg in segments for sid in seg["sample_ids"])
        assert trained == expected, (
            f"epoch {epoch}: missing {len(expected - trained)}, repeated {len(trained - expected)}"
        )
    epoch0 = sorted(read_ledger(run.ledger, 0), key=lambda s: s["packs"])
    packs = epoch0[-1]["packs"][1]
    assert 0 < killed["cursor"] < packs, "the kill must land mid-epoch"
    # The first attempt's work up to its committed checkpoint was kept; what followed was trained by the restarted
    # group.
    assert killed["pid"] in {s["pid"] for s in epoch0 if s["packs"][1] <= killed["committed"]}
    assert killed["pid"] not in {s["pid"] for s in epoch0 if s["packs"][0] >= killed["cursor"]}
    # The killed trainer's prefetched states were handed to it as files; the restarted workers reclaimed them.
    assert not list(Path("/dev/shm").glob(f"raypipe-states-*/owner-{killed['pid']}")), (
        "states of the killed trainer were left behind"
    )
    curve = read_training_curve(run.ledger)
    logged = [s["step"] for s in curve]
    # Steps after the checkpoint were replayed, not skipped or doubled: every step is in exactly one logged interval.
    assert logged == sorted(set(logged)) and sum(s["steps"] for s in curve) == logged[-1]


def test_a_resume_on_more_workers_trains_across_the_change_every_sample_once(
    prepared: Path, replies, service, tmp_path: Path
) -> None:
    """Issue 40: a run stopped mid-epoch on 1 worker and resumed on 2 (train.run.num_workers may change on a resume)
    trains the rest of both epochs, every sample exactly once per epoch, and its schedule ends where the run does.
    Before, the run's length was recomputed for the new size and compared with the old size's step count: the resumed
    run stopped short (on fewer workers, its schedule would run past the end)."""
    one = with_replies(
        run_config(
            prepared,
            tmp_path,
            "train.schedule.epochs=2",
            "train.run.checkpoint_every=6",
            "train.run.max_failures=0",
            "train.run.num_workers=1",
        ),
        replies,
    )
    run = RunFolders.of(one)
    killed: dict = {}

    def stop_after_a_committed_checkpoint() -> dict | None:
        segments = run.ledger.glob("epoch-0000/*.rank-0000.json") if run.root.exists("ledger") else []
        if len(segments) < 2 or not run.ray_train.exists(f"{one.name}/checkpoint_manager_snapshot.json"):
            return None
        second = run.ledger.read_json(segments[1])
        os.kill(second["pid"], signal.SIGKILL)  # no failure allowed: the run ends here, mid-epoch 0
        killed.update(cursor=second["packs"][1])
        return killed

    with pytest.raises(TrainingFailedError):
        train_while(one, stop_after_a_committed_checkpoint)
    assert killed
    two = with_replies(
        run_config(prepared, tmp_path, "train.schedule.epochs=2", "train.run.checkpoint_every=6"), replies
    )
    assert two.train.run.num_workers == 2 and train(two).error is None
    expected = Counter(_all_sample_ids(two))
    for epoch in range(2):
        trained = Counter(sid for seg in read_ledger(run.ledger, epoch) for sid in seg["sample_ids"])
        missing, repeated = len(expected - trained), len(trained - expected)
        assert trained == expected, f"epoch {epoch}: missing {missing}, repeated {repeated}"
    assert run.ledger.glob("epoch-0001/*.rank-0001.json"), "epoch 1 is trained by both workers"
    curve = read_training_curve(run.ledger)
    assert curve[-1]["lr"] < 0.05 * two.train.optim.lr, "the schedule ends where the run does"


def test_a_killed_replica_mid_epoch_loses_no_sample_and_leaves_no_state_files(
    prepared: Path, replies, service, tmp_path: Path
) -> None:
    cfg = with_replies(
        run_config(prepared, tmp_path, "train.schedule.epochs=1", "train.run.checkpoint_every=6"), replies
    )
    run = RunFolders.of(cfg)
    replica = service.stats.remote().result()["pid"]

    def kill_the_replica_mid_epoch() -> dict | None:
        if not (run.root.exists("ledger") and run.ledger.glob("epoch-0000/*.json")):
            return None
        os.kill(replica, signal.SIGKILL)
        return {"at": run.ledger.glob("epoch-0000/*.json")}

    result, killed = train_while(cfg, kill_the_replica_mid_epoch)
    assert result.error is None and killed
    assert (
        service.stats.remote().result()["pid"] != replica
    )  # Serve replaced it; the client resubmitted what was in flight
    trained = Counter(sid for seg in read_ledger(run.ledger, 0) for sid in seg["sample_ids"])
    assert trained == Counter(_all_sample_ids(cfg)), "a sample was lost or repeated"
    # What a replica does every minute, once this run's trainer processes have exited (Ray ends them after the run
    # returns): the dead replica's files and whatever was handed to those trainers and never read are removed.
    trainers = {seg["pid"] for seg in read_ledger(run.ledger, 0)}
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in trainers) and time.monotonic() < deadline:
        time.sleep(0.5)
    reclaim_orphans()
    leftovers = [str(p) for pid in trainers for p in Path("/dev/shm").glob(f"raypipe-states-*/owner-{pid}/*")]
    assert not leftovers and not list(Path("/dev/shm").glob(f"raypipe-states-{replica}-*")), leftovers


def test_s3_storage_hybrid_cache_fsdp2_then_an_offline_run_from_the_cache(
    prepared: Path, replies, service, s3_server, tmp_path: Path
) -> None:
    options = json.dumps(s3_server)
    common = [
        "train.output=s3://raypipe/runs/s3test",
        f"train.storage_options={options}",
        "train.states.cache=s3://raypipe/cache/s3test",
        "train.schedule.max_steps=6",
        "train.run.checkpoint_every=3",
    ]
    cfg = with_replies(
        run_config(prepared, tmp_path, *common, "train.states.mode=hybrid", "train.run.strategy=fsdp2"), replies
    )
    assert train(cfg).error is None
    run = RunFolders.of(cfg)
    assert [s["step"] for s in read_training_curve(run.ledger)] == [3, 6]  # metrics reduced at each checkpoint
    assert run.ray_train.glob(f"{cfg.name}/checkpoint_*/drafter/model.safetensors"), "checkpoints are in the bucket"
    cached = Storage(cfg.train.states.cache, s3_server).glob("*/*.pt")
    assert len(cached) > 0
    export = export_drafter(cfg)
    assert Storage(export["speculative_config"]["model"], s3_server).exists("model.safetensors")

    # Offline: the same steps read every state from the cache; the service is not asked (its request count stays put).
    before = service.stats.remote().result()["requests"]
    offline = run_config(prepared, tmp_path, *common, "name=debug_cpu_offline", "train.states.mode=offline")
    assert train(offline).error is None
    assert [s["step"] for s in read_training_curve(RunFolders.of(offline).ledger)] == [3, 6]
    assert service.stats.remote().result()["requests"] == before
    assert Storage(cfg.train.states.cache, s3_server).glob("*/*.pt") == cached


def test_attaching_to_a_service_that_serves_another_target_is_refused(prepared: Path, service, tmp_path: Path) -> None:
    from raypipe.serve.deployment import ensure_service

    cfg = run_config(prepared, tmp_path)
    assert ensure_service(cfg).describe.remote().result()["model"] == cfg.serve.model
    other = run_config(prepared, tmp_path, "serve.model=builtin:demo", "serve.layer_ids=[1,2,3,4]")
    with pytest.raises(ValueError, match="serve shutdown"):
        ensure_service(other)
