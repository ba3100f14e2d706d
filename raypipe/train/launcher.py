"""Ray Train wiring of the training stage: one TorchTrainer, its workers, storage and failure policy.

Workers take `train.run.resource` (a custom resource on the Train GPU nodes, so
they never share a GPU with Serve replicas) inside a placement group with
`train.run.placement_strategy`. Checkpoints go to the run's `ray_train/{name}`
(raypipe.layout) through pyarrow's view of the same fsspec filesystem (so
`s3://` with a custom endpoint works). A worker failure restarts the group from the last checkpoint
up to `train.run.max_failures` times; re-running the same config resumes too.

Checkpoints are scored by `train_loss`, the mean training loss of the steps
since the previous checkpoint (raypipe.train.loop), or, with `eval.every_steps`,
by τ in vLLM at temperature 0 measured at the checkpoint (raypipe.train.tau_rule):
Ray Train keeps the `train.run.keep_checkpoints` best beside the latest, which
it always keeps and resumes from; export takes the best (`best_checkpoint`; on a
tie of τ, the later). The engine that measures τ (raypipe.eval.probe) starts
before the workers and ends with the run.

A run is resumed or exported only under what its checkpoints were trained
with: the same prepared data (the manifest's digest), the same target (its
digest: weights updated in place under the same serve.model count) and the
same train config but for how it is executed (workers, resources, intervals,
service).
Anything else is refused with a message naming the differences: Ray Train
restores a run by name, and a silent resume would pass another config's state
off as this one's.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from raypipe.compat.ray import checkpoint_snapshot_filename
from raypipe.config import RaypipeConfig, trained_settings
from raypipe.data.output import PreparedOutput
from raypipe.eval.probe import start_probe, stop_probe
from raypipe.heap import HEAP_ENV
from raypipe.layout import RunFolders
from raypipe.storage import Storage, absolute
from raypipe.target import resolve_target, target_digest
from raypipe.train.checkpoint import CONFIG_FILE, PROVENANCE_FILE
from raypipe.train.loop import STOPPED, train_worker
from raypipe.train.replies import open_rows
from raypipe.train.tau_rule import SCORE as TAU_SCORE
from raypipe.train.tau_rule import TauTooLow
from raypipe.train.vocab import prepare_draft_vocab


def _train_storage(cfg: RaypipeConfig) -> tuple[Storage, Any]:
    """Ray Train's storage directory and pyarrow's view of the same fsspec filesystem (s3 endpoints included)."""
    import pyarrow.fs

    storage = RunFolders.of(cfg).ray_train
    storage.fs.makedirs(storage.path(), exist_ok=True)
    return storage, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(storage.fs))


LOSS_SCORE = "train_loss"  # what checkpoints are ranked by (lower is better), unless τ is measured in training


def checkpoint_score(cfg: RaypipeConfig) -> tuple[str, str]:
    """The metric checkpoints are ranked by and its order (Ray Train's checkpoint_score_order)."""
    return (TAU_SCORE, "max") if cfg.eval.every_steps else (LOSS_SCORE, "min")


def _checkpoint_at(storage: Storage, checkpoint: Any) -> Storage:
    """A Ray Train checkpoint as a Storage below the run's train storage (same filesystem and options)."""
    return storage.child(checkpoint.path[len(storage.root.rstrip("/")) + 1 :])


def _recorded(cfg: RaypipeConfig) -> tuple[Storage, Any]:
    """The run's train storage and Result as Ray Train recorded it (a killed upload may leave unrecorded folders)."""
    from ray.train import Result

    storage, pyarrow_fs = _train_storage(cfg)
    if not storage.exists(cfg.name):
        raise ValueError(
            f"no training run {cfg.name!r} under {storage.url}: train first (`raypipe train` with this config)"
        )
    result = Result.from_path(storage.path(cfg.name), storage_filesystem=pyarrow_fs)
    if result.checkpoint is None:
        raise ValueError(f"training run {cfg.name!r} under {storage.url} has no checkpoint yet")
    _refuse_other_settings(cfg, storage, result)
    return storage, result


def trained_with(config: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint is the state of, by dotted key: the prepared data and the target's digest (from its
    provenance; a checkpoint of an older raypipe has none, so its target is unknown) and the content fields
    (raypipe.config.trained_settings); execution fields may change on a resume."""
    return {
        "data manifest sha256": provenance["data_manifest_sha256"],
        "target digest": provenance.get("target_digest"),
        **trained_settings(config),
    }


def _refuse_other_settings(cfg: RaypipeConfig, storage: Storage, result: Any) -> None:
    """A ValueError naming the differences when the run's latest checkpoint was trained with other settings or data."""
    latest = _checkpoint_at(storage, result.checkpoint)
    saved = trained_with(latest.read_json(CONFIG_FILE), latest.read_json(PROVENANCE_FILE))
    now = trained_with(
        cfg.public_dump(),
        {
            "data_manifest_sha256": PreparedOutput.of(cfg.data).manifest_sha256(),
            "target_digest": target_digest(cfg.serve),
        },
    )
    changed = [
        f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now"
        for k in sorted(saved.keys() | now.keys())
        if saved.get(k) != now.get(k)
    ]
    if changed:
        raise ValueError(
            f"training run {cfg.name!r} under {storage.url} was trained with other settings or data "
            f"({'; '.join(changed)}); resuming or exporting it would pass its state off as this config's: set a new "
            "run name (name=...) to train anew, or go back to its settings"
        )


def check_resume(cfg: RaypipeConfig) -> None:
    """Before training: a run Ray Train would restore (it has a recorded checkpoint) must have been trained with these
    settings."""
    from ray.train import Result

    storage, pyarrow_fs = _train_storage(cfg)
    storage.refresh()  # a killed run's workers wrote here from other processes
    if storage.exists(f"{cfg.name}/{checkpoint_snapshot_filename()}"):  # what Ray Train restores a run from
        result = Result.from_path(storage.path(cfg.name), storage_filesystem=pyarrow_fs)
        if result.checkpoint is not None:
            _refuse_other_settings(cfg, storage, result)


def latest_checkpoint(cfg: RaypipeConfig) -> Storage:
    """The run's latest checkpoint: where a resumed run starts."""
    storage, result = _recorded(cfg)
    return _checkpoint_at(storage, result.checkpoint)


def best_checkpoint(cfg: RaypipeConfig) -> Storage:
    """The kept checkpoint with the lowest finite `train_loss`, or the highest τ in vLLM (the later one on a tie):
    what export takes."""
    storage, result = _recorded(cfg)
    score, order = checkpoint_score(cfg)
    scored = [
        (m[score], m.get("step", 0), c)
        for c, m in result.best_checkpoints
        if isinstance(m.get(score), (int, float)) and math.isfinite(m[score])
    ]
    if not scored:
        raise ValueError(
            f"no checkpoint of training run {cfg.name!r} under {storage.url} has a finite {score}: every step of it "
            "was skipped as non-finite"
        )
    if order == "max":
        best = max(scored, key=lambda s: (s[0], s[1]))[2]
    else:
        best = min(scored, key=lambda s: s[0])[2]
    return _checkpoint_at(storage, best)


def run_config(cfg: RaypipeConfig) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig

    from raypipe.console import verbose

    storage, pyarrow_fs = _train_storage(cfg)
    score, order = checkpoint_score(cfg)
    return RunConfig(
        name=cfg.name,
        storage_path=storage.path(),
        storage_filesystem=pyarrow_fs,
        checkpoint_config=CheckpointConfig(
            num_to_keep=cfg.train.run.keep_checkpoints,
            checkpoint_score_attribute=score,
            checkpoint_score_order=order,
        ),
        failure_config=FailureConfig(max_failures=cfg.train.run.max_failures),
        # Ray Train's INFO lines (state transitions, resources, checkpoints) only with --verbose (raypipe.progress).
        logging_config=LoggingConfig(log_level="INFO" if verbose() else "WARNING"),
        # Ray Train 2.60 sends a worker's print() both to its logger and, as Ray wraps stdout, to stdout: twice.
        worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **HEAP_ENV}},
    )


def scaling_config(cfg: RaypipeConfig) -> Any:
    from ray.train import ScalingConfig

    tc = cfg.train
    resources: dict[str, float] = {"CPU": tc.run.cpus_per_worker}
    if tc.run.use_gpu:
        resources["GPU"] = 1
    if tc.run.resource:
        resources[tc.run.resource] = 1
    return ScalingConfig(
        num_workers=tc.run.num_workers,
        use_gpu=tc.run.use_gpu,
        resources_per_worker=resources,
        placement_strategy=tc.run.placement_strategy,
    )


def run_training(cfg: RaypipeConfig) -> Any:
    """Train to the end of the configured epochs (or max_steps); returns Ray Train's Result.

    The same config resumes a finished or interrupted run from its last checkpoint
    (Ray Train restores a run by name and storage path); other settings are refused (`check_resume`).
    """
    cfg = RaypipeConfig.model_validate(cfg.model_dump())
    cfg.data.output = absolute(cfg.data.output)
    cfg.train.output = absolute(cfg.train.output)
    if cfg.train.states.cache:
        cfg.train.states.cache = absolute(cfg.train.states.cache)
    check_resume(cfg)  # before the replies' meta is written or a worker starts
    rows = open_rows(cfg)
    missing = rows.shards_needing_replies()  # fail here, not in every retried worker
    if missing:
        raise ValueError(
            f"{len(missing)} prepared shards lack on-policy replies: run the reply pass first "
            "(raypipe.train.replies.run_replies; `raypipe train` and the pipeline do)"
        )
    if cfg.train.drafter.draft_vocab_size is not None:  # counted once, before the workers read it
        prepare_draft_vocab(cfg, rows, resolve_target(cfg.serve).shape.vocab_size)
    if not cfg.eval.every_steps:
        return build_trainer(cfg).fit()
    folders = RunFolders.of(cfg)
    if folders.ledger.exists(STOPPED):
        folders.ledger.fs.rm(folders.ledger.path(STOPPED))  # a new start measures anew
    probe = start_probe(cfg)
    try:
        result = build_trainer(cfg).fit()
    except Exception:
        _raise_if_stopped(folders)
        raise
    finally:
        stop_probe(probe)
    if result.error is not None:
        _raise_if_stopped(folders)
    return result


def _raise_if_stopped(folders: RunFolders) -> None:
    """The fail-fast rule's message (raypipe.train.tau_rule), not Ray Train's wrapping of it, when it stopped the
    run."""
    if folders.ledger.exists(STOPPED):
        raise TauTooLow(folders.ledger.read_json(STOPPED)["message"]) from None


def build_trainer(cfg: RaypipeConfig) -> Any:
    """The TorchTrainer of a run. The config (credentials included) travels inside the worker function, not as a
    train_loop_config: Ray Train's state export shows that on the dashboard."""
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        functools.partial(train_worker, {"config": cfg.model_dump()}),
        # Checkpoint gathers use CPU tensors.
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if cfg.train.run.use_gpu else "gloo"),
        scaling_config=scaling_config(cfg),
        run_config=run_config(cfg),
    )
