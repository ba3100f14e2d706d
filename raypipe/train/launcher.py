"""Ray Train wiring of the training stage: one TorchTrainer, its workers, storage and failure policy.

Workers take `train.resource` (a custom resource on the Train GPU nodes, so
they never share a GPU with Serve replicas) inside a placement group with
`train.placement_strategy`. Checkpoints go to `{train.output}/ray_train/{name}`
through pyarrow's view of the same fsspec filesystem (so `s3://` with a custom
endpoint works). A worker failure restarts the group from the last checkpoint
up to `train.max_failures` times; re-running the same config resumes too.
"""

from __future__ import annotations

from typing import Any

from raypipe.config import RaypipeConfig
from raypipe.storage import Storage, absolute
from raypipe.train.loop import train_worker
from raypipe.train.replies import open_rows

TRAIN_DIR = "ray_train"


def _train_storage(cfg: RaypipeConfig) -> tuple[Storage, Any]:
    """Ray Train's storage directory and pyarrow's view of the same fsspec filesystem (s3 endpoints included)."""
    import pyarrow.fs

    storage = Storage(cfg.train.output, cfg.train.storage_options).child(TRAIN_DIR)
    storage.fs.makedirs(storage.path(), exist_ok=True)
    return storage, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(storage.fs))


def latest_checkpoint(cfg: RaypipeConfig) -> Storage:
    """The run's latest checkpoint as Ray Train recorded it (a killed upload may leave unrecorded folders)."""
    from ray.train import Result

    storage, pyarrow_fs = _train_storage(cfg)
    if not storage.exists(cfg.name):
        raise ValueError(f"no training run {cfg.name!r} under {storage.url}: train first (`raypipe train` with this config)")
    checkpoint = Result.from_path(storage.path(cfg.name), storage_filesystem=pyarrow_fs).checkpoint
    if checkpoint is None:
        raise ValueError(f"training run {cfg.name!r} under {storage.url} has no checkpoint yet")
    return storage.child(checkpoint.path[len(storage.root.rstrip("/")) + 1 :])


def run_config(cfg: RaypipeConfig) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    storage, pyarrow_fs = _train_storage(cfg)
    return RunConfig(
        name=cfg.name,
        storage_path=storage.path(),
        storage_filesystem=pyarrow_fs,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
        failure_config=FailureConfig(max_failures=cfg.train.max_failures),
    )


def scaling_config(cfg: RaypipeConfig) -> Any:
    from ray.train import ScalingConfig

    tc = cfg.train
    resources: dict[str, float] = {"CPU": tc.cpus_per_worker}
    if tc.use_gpu:
        resources["GPU"] = 1
    if tc.resource:
        resources[tc.resource] = 1
    return ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources, placement_strategy=tc.placement_strategy)


def run_training(cfg: RaypipeConfig) -> Any:
    """Train to the end of the configured epochs (or max_steps); returns Ray Train's Result.

    The same config resumes a finished or interrupted run from its last checkpoint
    (Ray Train restores a run by name and storage path).
    """
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = RaypipeConfig.model_validate(cfg.model_dump())
    cfg.data.output = absolute(cfg.data.output)
    cfg.train.output = absolute(cfg.train.output)
    if cfg.train.cache:
        cfg.train.cache = absolute(cfg.train.cache)
    missing = open_rows(cfg).shards_needing_replies()  # fail here, not in every retried worker
    if missing:
        raise ValueError(f"{len(missing)} prepared shards lack on-policy replies: run the reply pass first (raypipe.train.replies.run_replies; `raypipe train` and the pipeline do)")
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"config": cfg.model_dump()},
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if cfg.train.use_gpu else "gloo"),  # checkpoint gathers use CPU tensors
        scaling_config=scaling_config(cfg),
        run_config=run_config(cfg),
    )
    return trainer.fit()
