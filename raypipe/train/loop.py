"""The per-worker training loop (runs inside a Ray Train worker), in named phases.

1. Replies (`load_replies`): the on-policy replies of needs_response rows,
   generated before training by the reply pass (raypipe.train.replies).
2. Plan (`plan_epochs`): every worker computes the same epoch plans
   (raypipe.train.plan) from the row lengths with replies.
3. Model (`Trainer.__init__`): the drafter on the training device, frozen
   embedding and head (one tensor for the drafter's logits and its targets)
   in bf16 on GPUs and replicated, wrapped for DDP or FSDP2 (the trainable
   parameters sharded, bf16 parameters, fp32 gradient reduction), optimizer
   and schedule, bundled with the progress in one TrainState
   (raypipe.train.step), restored from the last checkpoint if the worker
   group restarted.
4. Steps (`Trainer.run`, one `Trainer.train_one` each): hidden states of
   the next `prefetch` steps are in flight; a background thread packs each
   step and copies it to the device (raypipe.train.batches); metrics stay on
   the device until every `log_every` steps (raypipe.train.metrics), when
   rank 0 prints one progress line and sets the Prometheus metrics and the
   experiment trackers (raypipe.train.trackers).
5. Checkpoints every `checkpoint_every` steps, at each epoch end and at the
   end, with the ledger of the samples trained since the last one
   (raypipe.train.ledger). A restarted group resumes at the checkpoint's data
   cursor, so every planned sample of an epoch is trained exactly once. Apart
   from the ledger, each rank appends every step's samples to the step log
   (raypipe.train.steplog), an audit of that which never relies on the ledger.
   Each checkpoint is scored by its interval's mean training loss
   (`train_loss`), or, with `eval.every_steps`, by τ in vLLM: Ray Train keeps
   the best ones beside the latest, and export takes the best
   (raypipe.train.launcher).
6. τ in vLLM (`Trainer.measure_tau`), with `eval.every_steps`: every that many
   steps and at each checkpoint, rank 0 sends the drafter's trainable weights
   (gathered by every rank) to the run's warm engine (raypipe.eval.probe) and
   waits for τ at every eval temperature; it joins that step's logged metrics
   (progress line, Prometheus, trackers, ledger: the τ curve) and the
   checkpoint's score. τ still below `eval.min_tau` after `eval.patience`
   measurements stops the run (raypipe.train.tau_rule), and the group's
   restarts stop at once (`STOPPED`).

A step with a NaN or Inf loss or gradient norm is skipped and counted
(raypipe.train.step); `train.run.max_nonfinite_steps` of them in a row stop the
run at the next log, before anything is checkpointed, and a model state
holding NaN or Inf is never checkpointed (raypipe.train.checkpoint).
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raypipe import __version__
from raypipe.config import RaypipeConfig
from raypipe.console import logger, quiet_console_handlers
from raypipe.layout import RunFolders
from raypipe.progress import LINE_EVERY_S, duration
from raypipe.serve.transport import process_identity, reclaim_orphans, release_owner
from raypipe.storage import Storage
from raypipe.target import Target, resolve_target, target_digest
from raypipe.train.anchors import anchor_count, install_row_anchors
from raypipe.train.batches import DeviceFeeder, Step
from raypipe.train.checkpoint import load_checkpoint, read_progress, save_checkpoint
from raypipe.train.drafter import build_drafter
from raypipe.train.ledger import Ledger, read_training_curve
from raypipe.train.metrics import StepMetrics, TrainMetrics, tracked
from raypipe.train.plan import EpochPlan, plan_epoch, total_steps
from raypipe.train.replies import open_rows
from raypipe.train.states import StateCache, stream_states
from raypipe.train.step import Progress, TrainState, place_drafter, precision, train_step
from raypipe.train.steplog import StepLog, new_attempt
from raypipe.train.tau_rule import SCORE, TauTooLow, check_tau, due, tau_key, trailing
from raypipe.train.trackers import Trackers
from raypipe.train.vocab import read_draft_vocab

STOPPED = "tau_stop.json"  # in the run's ledger: the fail-fast rule's message, which the group's restarts repeat


def stop_if_diverged(m: dict[str, float], cfg: RaypipeConfig, step: int) -> None:
    """Stop the run once `train.run.max_nonfinite_steps` steps in a row were skipped as non-finite (`m`: a reduced
    interval)."""
    tc = cfg.train
    if m["nonfinite_run"] >= tc.run.max_nonfinite_steps:
        raise ValueError(
            f"{m['nonfinite_run']:.0f} optimizer steps in a row up to step {step} had a NaN or Inf loss or gradient "
            f"norm and were skipped (train.run.max_nonfinite_steps={tc.run.max_nonfinite_steps}); nothing after "
            f"the last checkpoint is kept. Lower train.optim.lr (now {tc.optim.lr}) or train.optim.grad_clip, or look "
            "for broken rows in the "
            f"prepared data ({cfg.data.output})"
        )


class Worker:
    """What a worker knows before it trains: its rank, device, target, run folders, data and service client."""

    def __init__(self, cfg: RaypipeConfig) -> None:
        import ray.train
        from ray import serve
        from ray.train.torch import get_device

        from raypipe.serve.client import HiddenStateClient
        from raypipe.serve.deployment import APP_NAME

        quiet_console_handlers()
        self.cfg = cfg
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = get_device()
        self.target: Target = resolve_target(cfg.serve)  # builtin targets are built on each node
        self.folders = RunFolders.of(cfg)  # train.output arrives absolute (raypipe.train.launcher)
        self.rows = open_rows(cfg, cache_shards=cfg.train.schedule.shuffle_window + 1)
        reclaim_orphans()  # state files handed to a previous attempt's trainers on this node
        self.client = (
            HiddenStateClient(serve.get_app_handle(APP_NAME), max_in_flight=cfg.train.states.prefetch)
            if cfg.train.states.mode != "offline"
            else None
        )


def load_replies(w: Worker) -> None:
    """Every needs_response row's stored reply; the reply pass runs before the workers start."""
    missing = w.rows.shards_needing_replies()
    if missing:
        raise ValueError(
            f"{len(missing)} prepared shards have needs_response rows without stored replies; run the reply pass "
            "first (raypipe.train.replies.run_replies)"
        )
    w.rows.load_replies()


def plan_epochs(w: Worker) -> list[EpochPlan]:
    """Every epoch's plan."""
    tc = w.cfg.train
    lengths = w.rows.lengths()
    plans = [
        plan_epoch(
            w.rows.shard_sizes,
            lengths,
            seed=tc.schedule.seed,
            epoch=e,
            window=tc.schedule.shuffle_window,
            budget=tc.schedule.step_tokens,
        )
        for e in range(tc.schedule.epochs)
    ]
    return plans


class Trainer:
    def __init__(self, w: Worker, plans: list[EpochPlan]) -> None:
        import ray.train

        tc = w.cfg.train
        self.w, self.tc, self.plans = w, tc, plans
        drafter = build_drafter(w.target, tc, read_draft_vocab(w.cfg, w.target.shape.vocab_size))
        install_row_anchors(drafter, tc.objective.max_anchors)
        checkpoint = ray.train.get_checkpoint()
        with checkpoint.as_directory() if checkpoint is not None else nullcontext(None) as d:
            done = read_progress(Path(d)) if d is not None else Progress()
            # The steps left at this run's world size, which a resume may change (raypipe.train.plan.total_steps).
            self.total_steps = total_steps(plans, w.world, done.epoch, done.cursor, done.step, tc.schedule.max_steps)
            self.state = TrainState.create(
                drafter, place_drafter(drafter, tc.run.strategy, w.device), tc, w.device, self.total_steps
            )
            if d is not None:
                load_checkpoint(Path(d), self.state)
        self.ledger = Ledger(w.folders.ledger, w.rank)
        progress = self.state.progress
        dist.barrier()
        if w.rank == 0:
            self.ledger.drop_after(progress.epoch, progress.cursor)
        dist.barrier()
        attempt = [new_attempt()]
        dist.broadcast_object_list(attempt, src=0)  # one id for this start of the group, shared by its ranks
        resumed = {"epoch": progress.epoch, "step": progress.step, "cursor": progress.cursor}
        self.steplog = StepLog(w.folders.steps, attempt[0], w.rank, w.world, resumed, self.total_steps)
        self.provenance = {
            "raypipe_version": __version__,
            "target": w.cfg.serve.model,
            "target_digest": target_digest(w.cfg.serve),  # the resume check compares it (raypipe.train.launcher)
            "target_path": w.target.path,
            "layer_ids": list(w.target.layer_ids),
            "data_manifest_sha256": w.rows.manifest_sha256,
            "world_size": w.world,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        }
        self.cache = (
            StateCache(Storage(tc.states.cache, tc.storage_options), w.cfg.serve, list(w.target.layer_ids))
            if tc.states.cache
            else None
        )
        self.prometheus = TrainMetrics(w.cfg.name) if w.rank == 0 else None
        self.trackers = Trackers.start(w.cfg) if w.rank == 0 else None  # beside the Prometheus metrics
        self.started = (time.perf_counter(), progress.step)  # the progress lines' rate and ETA
        self.last_line = 0.0
        self.metrics = StepMetrics(w.device)
        self.since_checkpoint = {
            "loss": 0.0,
            "trained": 0.0,
            "nonfinite_steps": 0.0,
        }  # loss weighted by the steps that trained
        self.states_dtype = precision(w.device)[1]
        self.tau = TauSchedule(w, progress.step) if w.cfg.eval.every_steps else None
        torch.manual_seed(tc.schedule.seed * 1_000_003 + w.rank * 7_919 + progress.step)  # anchors per rank and step

    def steps_of_epoch(self, plan: EpochPlan, cursor: int, count: int) -> Iterator[Step]:
        """This rank's packs of `count` steps from `cursor`; a rank without a pack in the epoch's last step repeats its
        step's first pack at zero weight (DDP needs every rank). Runs on the feeder thread."""
        w = self.w
        for s in range(count):
            index = plan.pack_index(cursor, s, w.rank, w.world)
            yield Step(
                index, [w.rows.row(int(i)) for i in plan.packs[index if index is not None else cursor + s * w.world]]
            )

    def with_states(self, steps: Iterator[Step]) -> Iterator[tuple[Step, list[Any]]]:
        """Each step with its rows' hidden states, requested `prefetch` steps ahead."""
        for_ids, for_rows = itertools.tee(steps)
        packs = ([r.input_ids for r in step.rows] for step in for_ids)
        states = stream_states(packs, self.tc.states.mode, self.w.client, self.cache, self.tc.states.store_misses)
        return zip(for_rows, states, strict=True)

    def log(self, lr: float, measure: bool = False) -> dict[str, float]:
        """Reduce the interval's metrics (a collective), with τ in vLLM when `measure`, then report them from rank 0;
        stop a run that no longer learns (every rank reads the same skip counts and τ, so every rank raises)."""
        m = self.metrics.reduce()
        progress = self.state.progress
        stop_if_diverged(m, self.w.cfg, progress.step)
        if measure and self.tau is not None:
            m.update(self.tau.measure(self.state, progress.step, m["tau_estimate"]))
        trained = m["steps"] - m["nonfinite_steps"]
        interval = self.since_checkpoint
        interval["loss"] += m["loss"] * trained if trained else 0.0
        interval["trained"] += trained
        interval["nonfinite_steps"] += m["nonfinite_steps"]
        m.update(
            epoch=progress.epoch,
            step=progress.step,
            lr=lr,
            wait_fraction=m["wait_s"] / max(m["step_s"], 1e-9),
            tokens_per_s=m["tokens"] / max(m["step_s"] / self.w.world, 1e-9),
        )
        if self.prometheus is not None and self.trackers is not None:
            self.prometheus.record(m)
            self.trackers.log(tracked(m), progress.step)
            self.ledger.log(m)
            now = time.perf_counter()
            if now - self.last_line >= LINE_EVERY_S or self.state.progress.step >= self.total_steps:
                self.last_line = now  # every interval goes to the trackers; the console gets a line every 30 s
                logger("train").info(self.progress_line(m))
        return m

    def progress_line(self, m: dict[str, float]) -> str:
        """One line per logged interval (rank 0): where the run is, how it learns, how fast, how long it has left."""
        progress = self.state.progress
        step, total = progress.step, self.total_steps
        since, first = self.started
        rate = (step - first) / max(time.perf_counter() - since, 1e-9)
        skipped = f", skipped {m['nonfinite_steps']:.0f} non-finite" if m["nonfinite_steps"] else ""
        served = f", τ in vLLM {self.tau.latest}" if self.tau is not None and self.tau.latest else ""
        return (
            f"step {step}/{total} ({100 * step / total:.0f}%) epoch {progress.epoch}: loss {m['loss']:.4f}, "
            f"τ~{m['tau_estimate']:.2f}{served}, {m['tokens_per_s']:.0f} tok/s, wait {100 * m['wait_fraction']:.0f}%"
            f"{skipped}; "
            f"{rate:.2f} steps/s, {duration((total - step) / rate) if rate > 0 else '?'} left"
        )

    def checkpoint(self, m: dict[str, float]) -> None:
        """Ledger, then checkpoint, scored by `train_loss` (the mean training loss of the steps since the last
        checkpoint, NaN when every one was skipped, which Ray Train ranks last); report() is a barrier costing
        seconds, so it is only called here."""
        import ray.train

        self.ledger.flush(self.state.progress.cursor)
        self.steplog.flush()
        interval = self.since_checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp), self.state, self.w.cfg.model_dump(), self.provenance, write=self.w.rank == 0)
            report = {k: m[k] for k in ("step", "epoch", "loss", "tau_estimate")}
            if self.tau is not None:
                report[SCORE] = m[tau_key(0.0)]  # measured at every checkpoint (raypipe.train.tau_rule.due)
            report.update(
                train_loss=interval["loss"] / interval["trained"] if interval["trained"] else float("nan"),
                nonfinite_steps=interval["nonfinite_steps"],
            )
            self.since_checkpoint = {"loss": 0.0, "trained": 0.0, "nonfinite_steps": 0.0}
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp) if self.w.rank == 0 else None)
        if self.trackers is not None:
            self.trackers.checkpoint()

    def run(self) -> None:
        """Every epoch from where the restored state stopped, to the end of the epochs or of `total_steps`."""
        progress = self.state.progress
        while progress.epoch < self.tc.schedule.epochs and progress.step < self.total_steps:
            plan = self.plans[progress.epoch]
            count = min(plan.steps(self.w.world, progress.cursor), self.total_steps - progress.step)
            self.state.model.train()
            steps = self.with_states(self.steps_of_epoch(plan, progress.cursor, count))
            tick = time.perf_counter()
            for step, batch in DeviceFeeder(steps, self.w.device, self.states_dtype):
                self.train_one(plan, step, batch, started=tick, waited=time.perf_counter() - tick)
                tick = time.perf_counter()
            if progress.cursor >= len(plan.packs):
                progress.epoch += 1
                progress.cursor = 0
        if self.trackers is not None:
            self.trackers.close()

    def anchors(self, step: Step) -> int:
        """The pack's anchors: up to train.objective.max_anchors per row, at most train.objective.max_pack_anchors."""
        tc = self.tc
        return anchor_count(
            [r.loss_mask for r in step.rows],
            tc.objective.max_anchors,
            tc.objective.max_pack_anchors,
            tc.drafter.block_size,
        )

    def train_one(
        self, plan: EpochPlan, step: Step, batch: dict[str, torch.Tensor], started: float, waited: float
    ) -> None:
        """One optimizer step (at zero weight for a rank's padding step), counted in the metrics and the ledger; then
        the log and the checkpoint when due."""
        tc, progress = self.tc, self.state.progress
        lr = self.state.optimizer.param_groups[0]["lr"]
        real = step.index is not None
        model_metrics = train_step(self.state, batch, self.anchors(step), weight=1.0 if real else 0.0)
        ids = [r.sample_id for r in step.rows] if real else []
        self.ledger.add(progress.epoch, progress.cursor, ids)
        self.steplog.add(progress.epoch, progress.step + 1, progress.cursor, ids)
        progress.step += 1
        progress.cursor = min(progress.cursor + self.w.world, len(plan.packs))
        tokens = float(batch["input_ids"].shape[1]) if real else 0.0
        self.metrics.add(
            model_metrics, tokens=tokens, wait_s=waited, step_s=time.perf_counter() - started, **step.sources
        )
        at_end = progress.cursor >= len(plan.packs) or progress.step >= self.total_steps
        checkpoint = progress.step % tc.run.checkpoint_every == 0 or at_end
        measure = due(progress.step, self.w.cfg.eval.every_steps, checkpoint)
        if progress.step % tc.run.log_every == 0 or checkpoint or measure:
            m = self.log(lr, measure)
            if checkpoint:
                self.checkpoint(m)


class TauSchedule:
    """τ in vLLM during training, on every rank: the weights gathered by all, measured by rank 0's call to the probe,
    the result and the fail-fast decision shared with all (raypipe.train.tau_rule)."""

    def __init__(self, w: Worker, step: int) -> None:
        from raypipe.eval.probe import find_probe

        self.w, self.curve, self.latest = w, [], ""
        if w.folders.ledger.exists(STOPPED):  # a restart of the group that the rule stopped
            raise TauTooLow(w.folders.ledger.read_json(STOPPED)["message"])
        self.probe = find_probe(w.cfg.name) if w.rank == 0 else None
        if self.probe is not None:
            import ray

            self.floor = ray.get(self.probe.started.remote())["floor"]["0"]
            key = tau_key(0.0)  # the measurements before a restart's checkpoint count toward eval.patience
            self.curve = [(int(s["step"]), s[key]) for s in read_training_curve(w.folders.ledger) if key in s]
            self.curve = [(s, t) for s, t in self.curve if s <= step]

    def measure(self, state: TrainState, step: int, estimate: float) -> dict[str, float]:
        """τ at every eval temperature for the drafter as it is now, as metrics (`tau_key`), with the seconds the
        training waited for it (`vllm_tau_seconds`: the gather, the engine's reload and generation); a collective."""
        start = time.perf_counter()
        full = state.model_state_dict()
        shared: list[Any] = [None]
        if self.probe is not None:
            import ray

            trainable = {n for n, p in state.drafter.named_parameters() if p.requires_grad}
            weights = {k: v for k, v in full.items() if k in trainable}  # the engine has the rest
            assert weights, "no trainable weight by the drafter's parameter names"
            with tempfile.TemporaryDirectory() as tmp:
                state.drafter.save_pretrained(tmp, state_dict=weights)
                result = ray.get(self.probe.measure.remote(Path(tmp, "model.safetensors").read_bytes()))
            taus = {tau_key(float(t)): tau for t, tau in result.items()}
            self.curve.append((step, taus[tau_key(0.0)]))
            self.latest = ", ".join(f"{tau:.2f}@T={t}" for t, tau in result.items())
            warning = trailing(taus[tau_key(0.0)], estimate, self.w.cfg.eval.threshold)
            if warning:
                logger("train").warning(f"step {step}: {warning}")
            try:
                check_tau(self.curve, self.w.cfg.eval.min_tau, self.w.cfg.eval.patience, self.floor, estimate)
                shared = [{**taus, "vllm_tau_seconds": time.perf_counter() - start}]
            except TauTooLow as err:
                self.w.folders.ledger.write_json(STOPPED, {"step": step, "message": str(err)})
                shared = [str(err)]
        dist.broadcast_object_list(shared, src=0)
        if isinstance(shared[0], str):
            raise TauTooLow(shared[0])
        return shared[0]


def train_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker."""
    w = Worker(RaypipeConfig.model_validate(loop_config["config"]))
    try:
        load_replies(w)
        Trainer(w, plan_epochs(w)).run()
    finally:
        release_owner(process_identity())  # states handed over to this worker whose responses never reached it
        reclaim_orphans()  # and the directory of a replica replaced meanwhile, once no live trainer owns files there
