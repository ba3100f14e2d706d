"""Experiment trackers (`train.run.trackers`): TensorBoard, Weights & Biases and MLflow, fed from rank 0.

At every logged interval rank 0 gives each tracker what it sets the Prometheus metrics to (raypipe.train.metrics:
loss, tau_estimate, lr, tokens_per_s, wait_fraction, nonfinite_steps, accuracy/{position}) at the optimizer step;
at the start, once, the run's config with credentials redacted, as hyperparameters.

- tensorboard (installed with raypipe, no account): event files in the run's `tensorboard/{name}/`
  (raypipe.layout). With a URL `train.output` (s3://...) they are written to a local folder first and copied
  there at every checkpoint and at the end; `tensorboard --logdir` reads either.
- wandb (`pip install raypipe[trackers]`): a run named after the run, in project WANDB_PROJECT (default raypipe),
  set up by wandb's own variables. WANDB_MODE=offline needs no account: it writes `wandb/offline-run-*` under
  WANDB_DIR, else under the run folder when it is local; `wandb sync` uploads it later.
- mlflow (`pip install raypipe[trackers]`): a run named after the run in experiment MLFLOW_EXPERIMENT_NAME (default
  raypipe) at MLFLOW_TRACKING_URI, else in a file store in the run's `mlflow/` (`MLFLOW_ALLOW_FILE_STORE=true
  mlflow ui --backend-store-uri file:<it>`; MLflow 3 opens file stores only with that variable, which raypipe sets).

These variables (credentials included) are read where rank 0 runs: set them in the job's runtime env or on the
nodes. raypipe never copies them into a runtime env, which Ray's dashboard shows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from raypipe.config import RaypipeConfig
from raypipe.console import logger
from raypipe.layout import RunFolders
from raypipe.storage import Storage, is_url

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_trackers(trackers: list[str], output: str) -> None:
    """A ValueError naming the fix when a tracker of `train.run.trackers` could not start (checked with the config)."""
    missing = [t for t in trackers if importlib.util.find_spec(PACKAGES[t]) is None]
    if missing:
        raise ValueError(
            f"train.run.trackers: {', '.join(missing)} requested but not installed: pip install raypipe[trackers]"
        )
    if "mlflow" in trackers and is_url(output) and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ValueError(
            f"train.run.trackers: mlflow with a URL train.output ({output}) needs MLFLOW_TRACKING_URI (a tracking "
            "server, "
            "or a file: URI of a local folder): its file store is local"
        )


def hyperparameters(cfg: RaypipeConfig) -> dict[str, str | int | float | bool]:
    """The config, credentials redacted, as dotted keys with scalar values (lists and None as JSON)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}{key}.", value)
        else:
            flat[prefix[:-1]] = node if isinstance(node, (str, int, float, bool)) else json.dumps(node)

    walk("", cfg.public_dump())
    return flat


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def checkpoint(self) -> None:
        """At a checkpoint: what the tracker holds is written where it belongs."""

    def close(self) -> None: ...


class TensorBoard:
    """Event files in the run's tensorboard/{name}/, through a local folder when the run folder is a URL."""

    def __init__(self, folder: Storage, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.folder = folder
        self.local = None if is_url(folder.url) else Path(folder.url)
        directory = self.local or Path(tempfile.mkdtemp(prefix="raypipe-tensorboard-"))
        self.writer = SummaryWriter(log_dir=str(directory))
        for summary in hparams(params, {"loss": float("nan")}):  # declares loss as the HPARAMS tab's metric
            self.writer.file_writer.add_summary(summary)
        logger("train").info(f"TensorBoard: tensorboard --logdir {folder.url}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def checkpoint(self) -> None:
        if self.local is None:
            directory = Path(self.writer.log_dir)
            for path in directory.iterdir():
                self.folder.write(path.name, path.read_bytes())

    def close(self) -> None:
        self.writer.close()
        self.checkpoint()


class WandB:
    """A W&B run; offline (WANDB_MODE=offline) it is a folder for `wandb sync`."""

    def __init__(self, folders: RunFolders, params: dict[str, Any]) -> None:
        import wandb

        directory = os.environ.get("WANDB_DIR") or (None if is_url(folders.root.url) else folders.root.url)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "raypipe"),
            name=folders.name,
            config=params,
            dir=directory,
            settings=wandb.Settings(console="off"),  # the worker's output already goes to Ray's logs
        )
        offline = f"{Path(self.run.dir).parent} (offline: `wandb sync` uploads it)"
        logger("train").info(f"W&B run: {offline if self.run.offline else self.run.url}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def checkpoint(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run at MLFLOW_TRACKING_URI, else in a file store in the run's mlflow/ folder."""

    def __init__(self, folders: RunFolders, params: dict[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or Path(folders.mlflow.url).as_uri()  # a URL output: refused
        if uri.startswith("file:"):  # MLflow 3 opens its file store only when asked to (mlflow-skinny has no SQLite)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "raypipe")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=folders.name).info.run_id
        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes up to 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        logger("train").info(f"MLflow run {self.run_id} at {uri}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def checkpoint(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """The run's trackers, on rank 0: each metric interval, each checkpoint, and the end go to every one of them."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @classmethod
    def start(cls, cfg: RaypipeConfig) -> Trackers:
        folders, params = RunFolders.of(cfg), hyperparameters(cfg)
        make = {
            "tensorboard": lambda: TensorBoard(folders.tensorboard, params),
            "wandb": lambda: WandB(folders, params),
            "mlflow": lambda: MLflow(folders, params),
        }
        return cls([make[name]() for name in cfg.train.run.trackers])

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def checkpoint(self) -> None:
        for tracker in self.trackers:
            tracker.checkpoint()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
