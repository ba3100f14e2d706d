"""NaN and Inf in a training step, a non-finite model at a checkpoint, safe loads, atomic export, the best checkpoint
kept.

A real DFlash drafter on the tiny target takes real steps on packed batches;
the fault is in the data (a NaN or Inf in one row's hidden states), as it
arrives from a broken service or cache.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypipe.config import RaypipeConfig, TrainConfig, load_config
from raypipe.storage import Storage
from raypipe.target import resolve_target
from raypipe.train.anchors import install_row_anchors
from raypipe.train.batches import drafter_inputs, pack_host
from raypipe.train.checkpoint import load_checkpoint, save_checkpoint
from raypipe.train.drafter import build_drafter, step_kwargs
from raypipe.train.export import export_checkpoint
from raypipe.train.loop import stop_if_diverged
from raypipe.train.metrics import StepMetrics
from raypipe.train.rows import Row
from raypipe.train.step import NONFINITE, Progress, TrainState, make_optimizer, place_drafter, precision, train_step
from tests.helpers import free_port, serve_config

TOKENS = 64


class Drafter:
    """A drafter on the tiny target with its optimizer and schedule, placed as the loop places it (DDP or FSDP2,
    gloo)."""

    def __init__(self, tiny_target: str, strategy: str = "ddp", lr: float = 1e-2) -> None:
        self.target = resolve_target(serve_config(tiny_target))
        self.tc = TrainConfig(
            output="unused",
            drafter={"draft_layers": 1, "block_size": 4},
            objective={"max_anchors": 16},
            optim={"lr": lr},
            schedule={"step_tokens": 256, "seed": 0},
            run={"use_gpu": False, "strategy": strategy},
        )
        drafter = build_drafter(self.target, self.tc, None)
        install_row_anchors(drafter, self.tc.objective.max_anchors)
        model = place_drafter(drafter, strategy, torch.device("cpu"))
        optimizer = make_optimizer(
            [p for p in model.parameters() if p.requires_grad], self.tc.optim.lr, self.tc.optim.weight_decay
        )
        autocast, self.dtype = precision(torch.device("cpu"))
        self.state = TrainState(
            drafter,
            model,
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
            self.tc.optim.grad_clip,
            step_kwargs(self.tc),
            autocast,
        )

    def batch(self, seed: int, fault: float | None = None) -> dict[str, torch.Tensor]:
        """A packed step of two rows; `fault` (NaN or Inf) written into one position of the second row's states."""
        rng = np.random.default_rng(seed)
        rows = [
            Row(f"r{seed}-{i}", rng.integers(0, 150_000, TOKENS).astype(np.int64), np.ones(TOKENS, np.int64))
            for i in range(2)
        ]
        states = [
            torch.from_numpy(
                rng.standard_normal((TOKENS, len(self.target.layer_ids), self.target.shape.hidden_size)).astype(
                    np.float32
                )
            )
            for _ in rows
        ]
        if fault is not None:
            states[1][TOKENS // 2, 0, 5] = fault
        return drafter_inputs(pack_host(rows, states, pin=False), self.dtype)

    def step(self, seed: int, fault: float | None = None) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)  # the same anchors for a step, whatever ran before
        return train_step(
            self.state, self.batch(seed, fault), 2 * 16
        )  # two rows of 64 supervised tokens, 16 anchors each

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.state.params]

    def moments(self) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
        return [
            (float(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone())
            for s in (self.state.optimizer.state[p] for p in self.state.params)
        ]


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real gloo process group of one rank, as a Ray Train worker has (the skip flag is all-reduced in it)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv(
        "MASTER_PORT", str(free_port())
    )  # restored after: a later subprocess must not inherit a stale port
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fault", [float("nan"), float("inf")])
def test_a_non_finite_step_is_skipped_counted_and_leaves_the_model_finite(
    tiny_target: str, one_rank_group: Any, fault: float
) -> None:
    d = Drafter(tiny_target)
    metrics = StepMetrics(torch.device("cpu"))
    first = d.step(1)
    assert first[NONFINITE].item() == 0.0 and torch.isfinite(first["loss_sum"])
    metrics.add(first)
    weights, moments = d.weights(), d.moments()

    bad = d.step(2, fault)
    assert bad[NONFINITE].item() == 1.0
    assert _equal(d.weights(), weights), "a skipped step changed the weights"
    assert all(torch.isfinite(w).all() for w in d.weights())
    after = d.moments()
    assert [m[0] for m in after] == [m[0] for m in moments] and all(
        torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(after, moments)
    )
    assert all(p.grad is None for p in d.state.params)
    metrics.add(bad)

    third = d.step(3)
    assert third[NONFINITE].item() == 0.0 and not _equal(d.weights(), weights), "training goes on after a skipped step"
    metrics.add(third)
    m = metrics.reduce()
    assert (m["steps"], m["nonfinite_steps"], m["nonfinite_run"]) == (
        3.0,
        1.0,
        1.0,
    )  # one skipped, the longest run of them: 1
    # The interval's loss is that of the two steps that trained: the skipped one adds nothing, not even its NaN.
    expected = (first["loss_sum"] + third["loss_sum"]) / (first["loss_total"] + third["loss_total"])
    assert m["loss"] == pytest.approx(expected.item())


def test_too_many_skipped_steps_in_a_row_stop_the_run_with_the_count_and_fixes(
    tiny_target: str, one_rank_group: Any
) -> None:
    cfg = load_config("debug_cpu", ["train.run.max_nonfinite_steps=3"])
    d = Drafter(tiny_target)
    metrics = StepMetrics(torch.device("cpu"))
    for seed, fault in [(1, None), (2, math.nan), (3, math.nan), (4, None), (5, math.nan), (6, math.nan)]:
        metrics.add(d.step(seed, fault))
    m = metrics.reduce()
    assert (m["nonfinite_steps"], m["nonfinite_run"]) == (4.0, 2.0)
    stop_if_diverged(m, cfg, step=6)  # two in a row: the run goes on
    metrics.add(d.step(7, math.nan))  # the third in a row, across the reduction
    m = metrics.reduce()
    assert (m["nonfinite_steps"], m["nonfinite_run"], m["steps"]) == (1.0, 3.0, 1.0)
    assert math.isnan(m["loss"]), "an interval whose every step was skipped has no loss"
    with pytest.raises(
        ValueError,
        match=r"3 optimizer steps in a row up to step 7 .*max_nonfinite_steps=3.*Lower train\.optim\.lr .*prepared "
        "data",
    ):
        stop_if_diverged(m, cfg, step=7)


def _save(d: Drafter, directory: Path, step: int) -> None:
    d.state.progress.step = step
    save_checkpoint(directory, d.state, {"name": "faults"}, {"target_path": d.target.path}, write=True)


def test_a_model_holding_nan_is_never_checkpointed(tiny_target: str, one_rank_group: Any, tmp_path: Path) -> None:
    d = Drafter(tiny_target)
    d.step(1)
    _save(d, tmp_path / "good", 1)
    assert (tmp_path / "good" / "drafter" / "model.safetensors").exists()
    name, param = next((n, p) for n, p in d.state.model.named_parameters() if p.requires_grad and p.dim() == 2)
    with torch.no_grad():
        param[0, 0] = math.inf
    (tmp_path / "bad").mkdir()
    with pytest.raises(
        ValueError, match=rf"refusing to checkpoint step 2: 1 trainable tensors hold NaN or Inf \({name}\)"
    ):
        _save(d, tmp_path / "bad", 2)
    assert not list((tmp_path / "bad").iterdir()), "nothing of the refused checkpoint is written"


def test_optimizer_and_scheduler_states_load_with_weights_only(
    tiny_target: str, one_rank_group: Any, tmp_path: Path
) -> None:
    d = Drafter(tiny_target)
    for seed in (1, 2):
        d.step(seed)
    _save(d, tmp_path, 2)
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.load(
            tmp_path / name, weights_only=True
        )  # raises on anything but tensors, numbers, strings and containers
    resumed = Drafter(tiny_target)
    load_checkpoint(tmp_path, resumed.state)
    assert resumed.state.progress == Progress(step=2)
    assert _equal(resumed.weights(), d.weights())
    assert [(m[0], m[1].tolist()) for m in resumed.moments()] == [(m[0], m[1].tolist()) for m in d.moments()]
    assert resumed.state.scheduler.state_dict()["last_epoch"] == d.state.scheduler.state_dict()["last_epoch"] == 2
    d.step(3)
    resumed.step(3)
    assert _equal(resumed.weights(), d.weights()), "the resumed optimizer takes the same step"


def test_a_failed_export_leaves_the_previous_export_intact(
    tiny_target: str, one_rank_group: Any, tmp_path: Path
) -> None:
    cfg = load_config("debug_cpu", [f"train.output={tmp_path / 'train'}"])
    d = Drafter(tiny_target)
    d.step(1)
    _save(d, tmp_path / "ckpt1", 1)
    d.step(2)
    _save(d, tmp_path / "ckpt2", 2)
    out = tmp_path / "export"
    first = export_checkpoint(cfg, Storage(str(tmp_path / "ckpt1"), {}), str(out))
    assert first["training_state"]["step"] == 1 and json.loads((out / "export.json").read_text()) == json.loads(
        json.dumps(first)
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    broken = tmp_path / "ckpt2"
    (broken / "provenance.json").write_text('{"target_path": ')  # a checkpoint torn by a killed upload
    with pytest.raises(json.JSONDecodeError):
        export_checkpoint(cfg, Storage(str(broken), {}), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the failed export touched the previous one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt1", "ckpt2", "export"], (
        "a temporary directory was left behind"
    )

    _save(d, broken, 2)
    second = export_checkpoint(cfg, Storage(str(broken), {}), str(out))
    assert (
        second["training_state"]["step"] == 2
        and json.loads((out / "export.json").read_text())["training_state"]["step"] == 2
    )
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt1", "ckpt2", "export"]


def _rank(rank: int, world: int, port: int, tiny_target: str, out: str) -> None:
    """Rank 1's batch carries a NaN, rank 0's does not: every rank must skip the same step, and no collective hangs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp2"):
        d = Drafter(tiny_target, strategy)
        # this rank's shard under FSDP2
        local = lambda d=d: [p.to_local() if hasattr(p, "to_local") else p for p in d.weights()]  # noqa: E731
        flags = [d.step(10 + rank)[NONFINITE].item()]
        before = local()
        flags.append(d.step(20 + rank, math.nan if rank == 1 else None)[NONFINITE].item())
        unchanged = _equal(local(), before)
        flags.append(d.step(30 + rank)[NONFINITE].item())
        report[strategy] = {
            "flags": flags,
            "unchanged": unchanged,
            "moved": not _equal(local(), before),
            "checksum": sum(float(w.double().sum()) for w in local()),
        }
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_every_rank_skips_the_step_only_one_rank_saw_nan(tiny_target: str, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, free_port(), tiny_target, str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    for strategy in ("ddp", "fsdp2"):
        assert r0[strategy]["flags"] == r1[strategy]["flags"] == [0.0, 1.0, 0.0], strategy
        assert (
            r0[strategy]["unchanged"] and r1[strategy]["unchanged"] and r0[strategy]["moved"] and r1[strategy]["moved"]
        ), strategy
    assert r0["ddp"]["checksum"] == r1["ddp"]["checksum"], "DDP replicas diverged"


def _report_scored_checkpoints(config: dict[str, Any]) -> None:
    """Checkpoints shaped as the loop writes them (config and provenance, which resume and export check), scored by
    `losses`."""
    import tempfile

    import ray.train

    for step, loss in enumerate(config["losses"]):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "step").write_text(str(step))
            Path(tmp, "config.json").write_text(json.dumps(config["config"]))
            Path(tmp, "provenance.json").write_text(json.dumps(config["provenance"]))
            ray.train.report({"step": step, "train_loss": loss}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


@pytest.mark.integration
def test_ray_train_keeps_the_best_checkpoint_beside_the_latest_and_export_takes_the_best(
    ray_cluster: str, tmp_path: Path
) -> None:
    """The launcher's real CheckpointConfig: one kept by score (lowest train_loss; NaN never best) plus the latest,
    always."""
    import hashlib

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from raypipe.target import target_digest
    from raypipe.train.launcher import best_checkpoint, latest_checkpoint, run_config

    cfg: RaypipeConfig = load_config(
        "debug_cpu",
        [f"train.output={tmp_path / 'train'}", f"data.output={tmp_path / 'prepared'}", "train.run.keep_checkpoints=1"],
    )
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text('{"counts": {}}')
    trainer = TorchTrainer(
        _report_scored_checkpoints,
        train_loop_config={
            "losses": [3.0, 1.0, float("nan"), 2.0, 5.0],
            "config": cfg.public_dump(),
            "provenance": {
                "data_manifest_sha256": hashlib.sha256(
                    (tmp_path / "prepared" / "manifest.json").read_bytes()
                ).hexdigest(),
                "target_digest": target_digest(cfg.serve),
            },
        },
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.25}),
        run_config=run_config(cfg),
    )
    assert trainer.fit().error is None
    assert best_checkpoint(cfg).read("step") == b"1"
    assert latest_checkpoint(cfg).read("step") == b"4"
    kept = Storage(str(tmp_path / "train" / "ray_train"), {}).glob("*/checkpoint_*/step")
    assert len(kept) == 2, kept
