"""Experiment trackers get the intervals the trainer reduces and the redacted config; read back with each one's own
reader: TensorBoard's EventAccumulator, W&B's offline transaction log, MLflow's client on a file store."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raypipe.config import REDACTED, RaypipeConfig, load_config
from raypipe.train.metrics import StepMetrics, tracked
from raypipe.train.trackers import Trackers
from tests.helpers import free_port

SECRET = "AKIA-not-a-real-key"
STEPS = (5, 10, 15)


def config(output: str, trackers: str) -> RaypipeConfig:
    return load_config(
        "debug_cpu",
        [
            f"train.output={output}",
            f"train.run.trackers={trackers}",
            f"data.storage_options={{key: {SECRET}, client_kwargs: {{endpoint_url: 'http://127.0.0.1:9000'}}}}",
        ],
    )


@pytest.fixture(scope="module")
def intervals() -> list[dict[str, float]]:
    """Three logged intervals as Trainer.log has them: StepMetrics reduced in a real (one-rank) gloo group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        out = []
        metrics = StepMetrics(torch.device("cpu"))
        for i, step in enumerate(STEPS):
            for _ in range(5):
                drafter = {"loss_sum": 3.0 - i, "loss_total": 1.0, "eal_sum": 1.5 + 0.2 * i, "eal_total": 1.0}
                drafter |= {"position_1_acc_sum": 0.4 + 0.1 * i, "position_1_acc_total": 1.0}
                model = {k: torch.tensor(v, dtype=torch.float64) for k, v in drafter.items()}
                metrics.add(model, tokens=512.0, wait_s=0.1, step_s=0.5)
            m = metrics.reduce()
            m.update(step=step, epoch=0, lr=1e-3 * (i + 1), wait_fraction=m["wait_s"] / m["step_s"])
            m["tokens_per_s"] = m["tokens"] / m["step_s"]
            out.append(m)
        return out
    finally:
        dist.destroy_process_group()


def run(cfg: RaypipeConfig, intervals: list[dict[str, float]]) -> None:
    """What rank 0 does: start, one log per interval, a checkpoint after the second, the end."""
    trackers = Trackers.start(cfg)
    for i, m in enumerate(intervals):
        trackers.log(tracked(m), int(m["step"]))
        if i == 1:
            trackers.checkpoint()
    trackers.close()


def test_tracked_scalars_are_the_prometheus_metrics(intervals: list[dict[str, float]]) -> None:
    assert tracked(intervals[0]) == pytest.approx(
        {
            "loss": 3.0,
            "tau_estimate": 1.5,
            "wait_fraction": 0.2,
            "lr": 1e-3,
            "tokens_per_s": 1024.0,
            "nonfinite_steps": 0.0,
            "accuracy/1": 0.4,
        }
    )


def tensorboard_events(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return events


def hparams_of(events: Any) -> dict[str, Any]:
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    [start] = [
        HParamsPluginData.FromString(content).session_start_info
        for content in events.PluginTagToContent("hparams").values()
        if HParamsPluginData.FromString(content).HasField("session_start_info")
    ]
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def test_tensorboard_event_files_hold_every_interval_and_the_redacted_config(
    tmp_path: Path, intervals: list[dict[str, float]]
) -> None:
    cfg = config(str(tmp_path / "run"), "[tensorboard]")
    assert cfg.train.run.trackers == ["tensorboard"] == config(str(tmp_path), "[tensorboard]").train.run.trackers
    run(cfg, intervals)
    events = tensorboard_events(tmp_path / "run" / "tensorboard" / cfg.name)
    for name in ("loss", "tau_estimate", "lr", "tokens_per_s", "wait_fraction", "accuracy/1"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(s, pytest.approx(tracked(m)[name])) for s, m in zip(STEPS, intervals, strict=True)], name
    params = hparams_of(events)
    assert params["train.optim.lr"] == pytest.approx(cfg.train.optim.lr) and params["name"] == cfg.name
    assert params["data.storage_options.key"] == REDACTED and SECRET not in json.dumps(params)


def test_tensorboard_with_a_url_output_writes_locally_and_copies_at_checkpoints(
    tmp_path: Path, intervals: list[dict[str, float]]
) -> None:
    cfg = config(f"file://{tmp_path}/run", "[tensorboard]")
    trackers = Trackers.start(cfg)
    trackers.log(tracked(intervals[0]), STEPS[0])
    folder = tmp_path / "run" / "tensorboard" / cfg.name
    assert not folder.exists()  # written to a local folder until the checkpoint
    trackers.checkpoint()
    assert [e.step for e in tensorboard_events(folder).Scalars("loss")] == [STEPS[0]]
    trackers.log(tracked(intervals[1]), STEPS[1])
    trackers.close()
    assert [e.step for e in tensorboard_events(folder).Scalars("loss")] == list(STEPS[:2])


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (run-*.wandb): a 7-byte header, then LevelDB's log format (32 KiB blocks
    of chunks: checksum, length, type; a block's tail shorter than a chunk header is padding)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, pending, records = path.read_bytes(), 32 * 1024, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            records.append(Record.FromString(pending))
            pending = b""
    return records


def test_wandb_offline_run_holds_the_history_and_the_redacted_config(
    tmp_path: Path, intervals: list[dict[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = config(str(tmp_path / "run"), "[wandb]")
    run(cfg, intervals)
    [log] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")  # in the run folder
    deadline = time.monotonic() + 120
    while not (records := wandb_records(log)) or records[-1].WhichOneof("record_type") != "exit":  # written late
        assert time.monotonic() < deadline, "the offline run's log never got its exit record"
        time.sleep(0.5)
    history = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == list(STEPS)
    assert [h["loss"] for h in history] == pytest.approx([tracked(m)["loss"] for m in intervals])
    assert [h["accuracy/1"] for h in history] == pytest.approx([tracked(m)["accuracy/1"] for m in intervals])
    [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == cfg.name
    config_items = {i.key: json.loads(i.value_json) for i in run_record.config.update}
    assert config_items["train.optim.lr"] == cfg.train.optim.lr
    assert config_items["data.storage_options.key"] == REDACTED and SECRET not in str(run_record.config)


def test_mlflow_file_store_holds_the_metric_history_and_the_redacted_params(
    tmp_path: Path, intervals: list[dict[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's client opens a file store only with it
    cfg = config(str(tmp_path / "run"), "[mlflow]")
    run(cfg, intervals)
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlflow").as_uri())  # the run folder's file store
    [found] = client.search_runs([client.get_experiment_by_name("raypipe").experiment_id])
    assert found.info.run_name == cfg.name and found.info.status == "FINISHED"
    for name in ("loss", "tau_estimate", "accuracy/1"):
        history = client.get_metric_history(found.info.run_id, name)
        assert [(h.step, h.value) for h in history] == [
            (s, pytest.approx(tracked(m)[name])) for s, m in zip(STEPS, intervals, strict=True)
        ]
    params = found.data.params
    assert float(params["train.optim.lr"]) == cfg.train.optim.lr
    assert params["data.storage_options.key"] == REDACTED and SECRET not in json.dumps(params)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())  # a tracking URI wins
    run(config(str(tmp_path / "run2"), "[mlflow]"), intervals[:1])
    assert (tmp_path / "elsewhere").is_dir() and not (tmp_path / "run2" / "mlflow").exists()


def test_a_tracker_that_cannot_start_is_refused_by_the_preflight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's preflight refuses it before any work; the config alone stays valid anywhere (a worker's machine
    need not have the packages or variables the driver checked)."""
    from raypipe.preflight import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: Python's own import blocker
    with pytest.raises(ValueError, match=r"wandb requested but not installed: pip install raypipe\[trackers\]"):
        preflight(config(str(tmp_path), "[tensorboard, wandb]"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    remote = config("s3://bucket/run", "[mlflow]")
    with pytest.raises(ValueError, match="mlflow with a URL train.output .* needs MLFLOW_TRACKING_URI"):
        preflight(remote)
    assert RaypipeConfig.model_validate(remote.model_dump()) == remote
