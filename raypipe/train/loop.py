"""The per-worker training loop (runs inside a Ray Train worker; generic over the drafter).

1. Replies: the workers split the prepared shards whose needs_response rows
   have no stored reply, ask the service for on-policy replies and store them.
2. Plan: every worker computes the same epoch plan (raypipe.train.plan) from
   the row lengths with replies, and trains its packs of each step.
3. Step: the states of the next `prefetch` steps are in flight while the
   current step computes; the drafter owns loss and metrics.
4. Checkpoint every `checkpoint_every` steps, at each epoch end and at the end,
   together with the ledger of the sample ids trained since the last one. A
   restarted worker group resumes at the checkpoint's data cursor, so every
   planned sample of an epoch is trained exactly once.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from raypipe import __version__
from raypipe.config import RaypipeConfig
from raypipe.data.output import PreparedOutput
from raypipe.serve.layers import resolve_layer_ids
from raypipe.storage import Storage
from raypipe.train.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from raypipe.train.drafter import build_drafter, step_kwargs
from raypipe.train.plan import EpochPlan, lr_factor, plan_epoch
from raypipe.train.rows import PreparedRows, Row, generate_replies
from raypipe.train.states import StateCache, stream_states


def pack_tensors(rows: list[Row], states: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One packed sequence: rows end to end, positions restarting per row, states split into aux layers and the last."""
    ids = np.concatenate([r.input_ids for r in rows])
    mask = np.concatenate([r.loss_mask for r in rows])
    docs = np.concatenate([np.full(len(r.input_ids), i) for i, r in enumerate(rows)])
    pos = np.concatenate([np.arange(len(r.input_ids)) for r in rows])
    hidden = torch.cat(states)  # [T, n_layers, H]
    for r, s in zip(rows, states):
        assert s.shape[0] == len(r.input_ids), f"states of {r.sample_id} have {s.shape[0]} positions for {len(r.input_ids)} tokens"
    t = len(ids)
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).unsqueeze(0).to(device)  # noqa: E731
    return {
        "input_ids": as_long(ids),
        "loss_mask": as_long(mask),
        "document_ids": as_long(docs),
        "position_ids": as_long(pos),
        "hidden_states": hidden[:, :-1, :].reshape(1, t, -1).to(device, dtype),
        "verifier_last_hidden_states": hidden[:, -1, :].reshape(1, t, -1).to(device, dtype),
    }


def precision(device: torch.device) -> tuple[Any, torch.dtype]:
    """(autocast, states dtype): bf16 autocast on GPU; fp32 on CPU, where the served bf16 states are widened."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16), torch.bfloat16
    return torch.autocast("cpu", enabled=False), torch.float32


def train_step(
    model: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: Any,
    batch: dict[str, torch.Tensor], kwargs: dict[str, Any], grad_clip: float, weight: float, autocast: Any,
) -> dict[str, torch.Tensor]:
    """One optimizer step on one packed sequence; the drafter computes loss and metrics."""
    with autocast:
        _, loss, model_metrics = model(**batch, **kwargs)
    (loss * weight).backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return model_metrics


class Ledger:
    """What was trained since the last checkpoint, written with it: sample ids per rank, step metrics on rank 0.

    It is the audit trail of exactly-once (a resumed run rewrites the segments
    after its checkpoint) and the training curve (loss, estimated acceptance).
    """

    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage = storage
        self.rank = rank
        self.ids: list[str] = []
        self.steps: list[dict[str, float]] = []
        self.start: tuple[int, int] | None = None

    def add(self, epoch: int, cursor: int, sample_ids: list[str], metrics: dict[str, float] | None) -> None:
        if self.start is None:
            self.start = (epoch, cursor)
        self.ids.extend(sample_ids)
        if metrics is not None:
            self.steps.append(metrics)

    def flush(self, end_cursor: int) -> None:
        if self.start is not None:
            epoch, start = self.start
            doc = {"epoch": epoch, "packs": [start, end_cursor], "rank": self.rank, "pid": os.getpid(), "sample_ids": self.ids, "steps": self.steps}
            self.storage.write_json(f"epoch-{epoch:04d}/packs-{start:09d}-{end_cursor:09d}.rank-{self.rank:04d}.json", doc)
        self.ids, self.steps, self.start = [], [], None

    def drop_after(self, epoch: int, cursor: int) -> None:
        """Forget segments of an interrupted attempt that start at or after the resumed cursor."""
        for rel in self.storage.glob(f"epoch-{epoch:04d}/packs-*.json"):
            if int(rel.rsplit("/", 1)[1].split("-")[1]) >= cursor:
                self.storage.fs.rm(self.storage.path(rel))
        for later in self.storage.glob("epoch-*"):
            if int(later.rsplit("-", 1)[1]) > epoch:
                self.storage.fs.rm(self.storage.path(later), recursive=True)


def _metrics(model_metrics: dict[str, torch.Tensor], extra: dict[str, float], block_size: int) -> dict[str, float]:
    """Sum every rank's counts, then turn sum/total pairs into means."""
    keys = sorted(model_metrics) + sorted(extra)
    vec = torch.tensor([float(model_metrics[k]) for k in sorted(model_metrics)] + [extra[k] for k in sorted(extra)], dtype=torch.float64)
    dist.all_reduce(vec)
    summed = dict(zip(keys, vec.tolist()))
    out = {k[: -len("_sum")]: summed[k] / max(summed[k[: -len("_sum")] + "_total"], 1.0) for k in keys if k.endswith("_sum")}
    out["tau_estimate"] = out.pop("eal")
    for pos in range(block_size):
        if f"position_{pos}_acc" in out:
            out[f"acc_pos_{pos}"] = out.pop(f"position_{pos}_acc")
    out.update({k: summed[k] for k in extra})
    return out


class _TrainMetrics:
    """Prometheus metrics of the trainer (exported by Ray with a ray_ prefix)."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Counter, Gauge

        tags = ("run",)
        self.tags = {"run": run}
        self.loss = Gauge("raypipe_train_loss", "Training loss of the last step.", tags)
        self.tau = Gauge("raypipe_train_tau_estimate", "Acceptance length estimated from the last step's draft accuracy.", tags)
        self.wait = Gauge("raypipe_train_wait_fraction", "Share of the last step spent waiting for hidden states.", tags)
        self.lr = Gauge("raypipe_train_lr", "Learning rate.", tags)
        self.tokens_per_s = Gauge("raypipe_train_tokens_per_s", "Tokens trained per second, all workers.", tags)
        self.steps = Counter("raypipe_train_steps", "Optimizer steps taken.", tags)
        self.accuracy = Gauge("raypipe_train_accuracy", "Draft accuracy of the last step by block position.", ("run", "position"))

    def record(self, m: dict[str, float]) -> None:
        self.loss.set(m["loss"], self.tags)
        self.tau.set(m["tau_estimate"], self.tags)
        self.wait.set(m["wait_fraction"], self.tags)
        self.lr.set(m["lr"], self.tags)
        self.tokens_per_s.set(m["tokens_per_s"], self.tags)
        self.steps.inc(1, self.tags)
        for key, value in m.items():
            if key.startswith("acc_pos_"):
                self.accuracy.set(value, {**self.tags, "position": key[len("acc_pos_") :]})


def _wrap(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def train_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker."""
    import ray.train
    from ray import serve
    from ray.train.torch import get_device

    from raypipe.serve.client import HiddenStateClient
    from raypipe.serve.deployment import APP_NAME, resolve_model

    cfg = RaypipeConfig.model_validate(loop_config["config"])
    target = resolve_model(cfg.serve.model)  # builtin:tiny is built on each node
    layer_ids = list(resolve_layer_ids(cfg.serve.layer_ids, AutoConfig.from_pretrained(target).num_hidden_layers))
    tc = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = get_device()
    run = Storage(tc.output, tc.storage_options)
    rows = PreparedRows(PreparedOutput(cfg.data.output, cfg.data.storage_options), run.child("replies"), cfg.data.max_length, cache_shards=tc.shuffle_window + 1)
    client = HiddenStateClient(serve.get_app_handle(APP_NAME), max_in_flight=tc.prefetch) if tc.hidden_states != "offline" else None

    # 1. On-policy replies for needs_response rows, once per run directory.
    sampling = {"temperature": tc.reply_temperature, "max_tokens": tc.reply_max_tokens, "seed": tc.seed}
    rows.check_replies_meta({"target": cfg.serve.model, "data_manifest_sha256": rows.manifest_sha256, "sampling": sampling}, write=rank == 0)
    todo = rows.shards_needing_replies()
    if todo:
        if client is None:
            raise ValueError(f"{len(todo)} prepared shards have needs_response rows without stored replies; run once online or hybrid so the service replies")
        generate_replies(rows, todo[rank::world], lambda batches: client.stream(batches, "generate", sampling=sampling))
    while rows.shards_needing_replies():  # other ranks still replying: poll storage, since a collective would time out on long reply phases
        time.sleep(5)
    rows.load_replies()
    lengths = rows.lengths()
    plans = [plan_epoch(rows.shard_sizes, lengths, seed=tc.seed, epoch=e, window=tc.shuffle_window, budget=tc.step_tokens) for e in range(tc.epochs)]
    total_steps = sum(p.steps(world) for p in plans)
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)

    # 2. Drafter, optimizer, schedule; resume from the last checkpoint if the group restarted.
    drafter = build_drafter(target, layer_ids, tc).to(device)
    model = _wrap(drafter, tc.strategy, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, tc.warmup_ratio))
    state = TrainingState()
    ledger = Ledger(run.child(f"ledger/{cfg.name}"), rank)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_checkpoint(Path(d), model, optimizer, scheduler)
    dist.barrier()
    if rank == 0:
        ledger.drop_after(state.epoch, state.cursor)
    dist.barrier()
    provenance = {
        "raypipe_version": __version__,
        "target": cfg.serve.model,
        "target_path": target,
        "layer_ids": layer_ids,
        "data_manifest_sha256": rows.manifest_sha256,
        "world_size": world,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    cache = StateCache(Storage(tc.cache, tc.storage_options), cfg.serve.model, layer_ids) if tc.cache else None
    metrics = _TrainMetrics(cfg.name) if rank == 0 else None
    kwargs = step_kwargs(tc)
    autocast, states_dtype = precision(device)
    torch.manual_seed(tc.seed * 1_000_003 + rank * 7_919 + state.step)  # anchors differ per rank and step, reproducibly

    def checkpoint_now(m: dict[str, float]) -> None:
        """Ledger, then checkpoint; report() is a barrier costing seconds, so it is only called here."""
        ledger.flush(state.cursor)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp), model, drafter, optimizer, scheduler, state, cfg.model_dump(), provenance, write=rank == 0)
            ray.train.report(m, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)

    # 3. Epochs from the cursor.
    while state.epoch < tc.epochs and state.step < total_steps:
        plan = plans[state.epoch]
        steps = min(plan.steps(world, state.cursor), total_steps - state.step)
        pending: deque[tuple[int | None, list[Row]]] = deque()

        def sequences(plan: EpochPlan = plan, steps: int = steps, cursor: int = state.cursor) -> Any:
            for s in range(steps):
                index = plan.pack_index(cursor, s, rank, world)
                # A rank without a pack in the epoch's last step repeats its step's first pack at zero weight (DDP needs every rank).
                step_rows = [rows.row(int(i)) for i in plan.packs[index if index is not None else s * world]]
                pending.append((index, step_rows))
                yield [r.input_ids for r in step_rows]

        model.train()
        waited = 0.0
        tick = time.perf_counter()
        for states in stream_states(sequences(), tc.hidden_states, client, cache, tc.store_misses):
            got = time.perf_counter()
            waited = got - tick
            index, step_rows = pending.popleft()
            batch = pack_tensors(step_rows, states, device, states_dtype)
            lr = optimizer.param_groups[0]["lr"]
            model_metrics = train_step(model, params, optimizer, scheduler, batch, kwargs, tc.grad_clip, 1.0 if index is not None else 0.0, autocast)
            cursor_before = state.cursor
            state.step += 1
            state.cursor = min(state.cursor + world, len(plan.packs))
            done = time.perf_counter()
            step_time = done - tick
            tokens = float(batch["input_ids"].shape[1]) if index is not None else 0.0
            m = _metrics(model_metrics, {"tokens": tokens, "wait_s": waited, "step_s": step_time}, tc.block_size)
            m.update(
                epoch=state.epoch, step=state.step, lr=lr,
                wait_fraction=m["wait_s"] / max(m["step_s"], 1e-9),
                tokens_per_s=m["tokens"] / max(m["step_s"] / world, 1e-9),
            )
            ledger.add(state.epoch, cursor_before, [r.sample_id for r in step_rows] if index is not None else [], m if rank == 0 else None)
            if metrics is not None:
                metrics.record(m)
                if state.step % 10 == 0 or state.step == total_steps:
                    print(f"[train] step {state.step}/{total_steps} epoch {state.epoch} loss {m['loss']:.4f} tau~{m['tau_estimate']:.2f} "
                          f"{m['tokens_per_s']:.0f} tok/s wait {100 * m['wait_fraction']:.1f}%", flush=True)
            if state.step % tc.checkpoint_every == 0 or state.cursor >= len(plan.packs) or state.step >= total_steps:
                checkpoint_now(m)
            tick = time.perf_counter()
        if state.cursor >= len(plan.packs):
            state.epoch += 1
            state.cursor = 0


def read_ledger(run: Storage, name: str, epoch: int) -> list[dict[str, Any]]:
    """The ledger segments of run `name`'s epoch (what each rank trained, checkpoint to checkpoint)."""
    return [json.loads(run.read(rel)) for rel in run.glob(f"ledger/{name}/epoch-{epoch:04d}/packs-*.json")]


def read_training_curve(run: Storage, name: str) -> list[dict[str, float]]:
    """Every step's metrics of run `name` (rank 0's ledger entries), in step order."""
    epochs = sorted(int(rel.rsplit("-", 1)[1]) for rel in run.glob(f"ledger/{name}/epoch-*"))
    return sorted((s for e in epochs for seg in read_ledger(run, name, e) for s in seg["steps"]), key=lambda s: s["step"])

