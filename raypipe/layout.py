"""A run's folders under `train.output`, named in one place.

    {train.output}/
      pipeline/{name}/{stage}.json
                             completion records of the one-job pipeline (raypipe.pipeline)
      service/{name}.json    while a job of this run has the hidden-state service it deployed up: a resubmitted job
                             stops that service too (raypipe.pipeline.train_stage)
      replies/               on-policy replies of needs_response rows (raypipe.train.replies)
      vocab/{name}/          the draft vocabulary's mapping, with train.drafter.draft_vocab_size
                             (raypipe.train.vocab)
      ray_train/{name}/      Ray Train's run: its state and checkpoints (raypipe.train.launcher)
      ledger/{name}/         what each rank trained, and the training curve (raypipe.train.ledger)
      steps/{name}/          every optimizer step's samples, per attempt and rank, never rewritten: the audit of
                             what the final model saw (raypipe.train.steplog)
      tensorboard/{name}/    TensorBoard's event files, with `train.run.trackers: [tensorboard]`
                             (raypipe.train.trackers)
      mlflow/, wandb/        MLflow's file store and W&B's offline runs, when their trackers write locally
      drafter/{name}/        the exported drafter (raypipe.train.export)
      eval/{name}/           eval.json and plots, unless `eval.output` is set (raypipe.eval.evaluate)
      logs/{name}/           the libraries' logs, one file per process (raypipe.console), where train.output is
                             local; else a local folder of each node (`log_dir`)

What a run produces is kept under its name (`name`); runs of several names share
only the on-policy replies, which depend on the data, the target and the reply
settings (recorded in replies/meta.json, which refuses others). The prepared data
(`data.output`, raypipe.data.output) and the state cache
(`train.states.cache`, raypipe.train.states) have settings of their own. A local
`train.output` is made absolute: Ray Train runs each worker in its own
working directory.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from raypipe.config import RaypipeConfig
from raypipe.storage import Storage, absolute, is_url


@dataclass(frozen=True)
class RunFolders:
    root: Storage  # train.output
    name: str  # the run's name: runs of several names share train.output

    @classmethod
    def of(cls, cfg: RaypipeConfig) -> RunFolders:
        return cls(Storage(absolute(cfg.train.output), cfg.train.storage_options), cfg.name)

    @property
    def stages(self) -> Storage:
        return self.root.child(f"pipeline/{self.name}")

    @property
    def replies(self) -> Storage:
        return self.root.child("replies")

    @property
    def vocab(self) -> Storage:
        return self.root.child(f"vocab/{self.name}")

    @property
    def ray_train(self) -> Storage:
        """Ray Train's storage path; it keeps each run under its name."""
        return self.root.child("ray_train")

    @property
    def ledger(self) -> Storage:
        return self.root.child(f"ledger/{self.name}")

    @property
    def steps(self) -> Storage:
        return self.root.child(f"steps/{self.name}")

    @property
    def tensorboard(self) -> Storage:
        return self.root.child(f"tensorboard/{self.name}")

    @property
    def mlflow(self) -> Storage:
        return self.root.child("mlflow")

    @property
    def export(self) -> Storage:
        return self.root.child(f"drafter/{self.name}")

    @property
    def eval(self) -> Storage:
        return self.root.child(f"eval/{self.name}")


def eval_output(cfg: RaypipeConfig) -> Storage:
    """Where the evaluation writes: `eval.output`, else the run's eval/{name}/."""
    if cfg.eval.output:
        return Storage(absolute(cfg.eval.output), cfg.train.storage_options)
    return RunFolders.of(cfg).eval


def log_dir(cfg: RaypipeConfig) -> str:
    """The run's log folder on each node: `{train.output}/logs/{name}` where train.output is local, else
    `{tmp}/raypipe-logs/{name}` (processes append to their log files, which object stores cannot take)."""
    if is_url(cfg.train.output):
        return str(Path(tempfile.gettempdir()) / "raypipe-logs" / cfg.name)
    return str(Path(absolute(cfg.train.output)) / "logs" / cfg.name)
