"""The whole run as one job: prepare -> hidden-state service -> train -> export -> evaluate.

Each stage records its completion in `{train.output}/pipeline/{stage}.json`
with a fingerprint of what its output depends on, so a re-submitted job skips
the stages already done for the same inputs and resumes the interrupted one
(the data stage skips completed shards, Ray Train restores the run from its
last checkpoint). Fingerprints come from content and chain stage to stage:
prepare's covers the data config, the tokenizer, the template's text, each
input file's size plus ETag or mtime and the raypipe version; train's covers
the digest of the manifest prepare wrote (every shard's checksum) and the
train and serve config; export's is train's, and eval's chains on it. A change
re-runs the stages it affects; where the old output cannot be reused safely,
the stage refuses with a message instead (a changed input under the same
data.output, a changed train config under the same run name). Credentials in
storage_options are redacted before hashing, so rotating one re-runs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raypipe.config import DataConfig, RaypipeConfig, fingerprint, trained_settings
from raypipe.console import logger
from raypipe.layout import RunFolders


def prepare_fingerprint(cfg: DataConfig) -> str:
    """The data config (redacted; data.output and parallelism included: a resume is cheap) and what the rows depend
    on."""
    from raypipe.data.output import dependencies
    from raypipe.data.tokenizer import resolve_tokenizer

    _, spec = resolve_tokenizer(cfg)
    return fingerprint({"data": cfg.public_dump(), "dependencies": dependencies(cfg, spec)})


def train_fingerprint(cfg: RaypipeConfig, manifest_sha256: str) -> str:
    """The prepared data by content (the manifest's digest covers every shard's checksum) and what the drafter is
    trained on and with (raypipe.config.trained_settings, as the resume check compares). How the run executes
    (workers, resources, intervals, where states come from) changes no drafter, so it re-runs nothing."""
    return fingerprint({"manifest_sha256": manifest_sha256, **trained_settings(cfg.public_dump())})


def eval_fingerprint(cfg: RaypipeConfig, trained: str) -> str:
    """The trained (and exported) drafter's fingerprint and the eval config."""
    return fingerprint({"train": trained, "eval": cfg.eval.public_dump()})


class StageLog:
    """Completion records of the stages of one run."""

    def __init__(self, cfg: RaypipeConfig) -> None:
        self.cfg = cfg
        self.storage = RunFolders.of(cfg).stages
        self._fingerprints: dict[str, str] = {}

    def fingerprint(self, stage: str) -> str:
        """Computed when first asked, in stage order: train's hashes the manifest the prepare stage wrote."""
        if stage not in self._fingerprints:
            from raypipe.data.output import PreparedOutput

            cfg = self.cfg
            if stage == "prepare":
                fingerprint = prepare_fingerprint(cfg.data)
            elif stage == "train":
                fingerprint = train_fingerprint(cfg, PreparedOutput.of(cfg.data).manifest_sha256())
            elif stage == "export":
                fingerprint = self.fingerprint("train")
            else:
                fingerprint = eval_fingerprint(cfg, self.fingerprint("export"))
            self._fingerprints[stage] = fingerprint
        return self._fingerprints[stage]

    def done(self, stage: str) -> dict[str, Any] | None:
        """The stage's record if it finished with what it depends on now."""
        self.storage.refresh()
        if not self.storage.exists(f"{stage}.json"):
            return None
        record = self.storage.read_json(f"{stage}.json")
        return record if record["fingerprint"] == self.fingerprint(stage) else None

    def mark(self, stage: str, seconds: float, summary: dict[str, Any]) -> None:
        self.storage.write_json(
            f"{stage}.json",
            {"stage": stage, "fingerprint": self.fingerprint(stage), "seconds": seconds, "summary": summary},
        )


def train_stage(cfg: RaypipeConfig) -> dict[str, Any]:
    """Replies, then training with the service up: started here unless one for this target already runs, and then
    stopped again, so that no replica holds its GPUs (and their nodes) after the run."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME, attach_service, ensure_service
    from raypipe.train.launcher import run_training
    from raypipe.train.replies import run_replies

    replies = run_replies(cfg)  # before the service: the reply engines take the Serve GPUs, the training GPUs stay free
    started, canary = False, None
    if cfg.train.states.mode != "offline":
        handle = attach_service(cfg.serve)  # checks a running service serves this target
        started = handle is None
        logger("train").info(f"{'starting' if started else 'attached to'} the hidden-state service")
        if started:
            handle = ensure_service(cfg.serve)
        canary = handle.stats.remote().result()["canary"]
        logger("train").info(f"service {canary or 'canary off'}")
    try:
        result = run_training(cfg)
    finally:
        if started:
            serve.delete(APP_NAME)  # its CPUs or GPUs go back to the evaluation (and the autoscaler)
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}")
    return {
        "canary": canary,
        "replies": replies,
        **{k: result.metrics[k] for k in ("step", "epoch", "loss", "tau_estimate") if k in result.metrics},
    }


def _stages(cfg: RaypipeConfig) -> dict[str, Callable[[], dict[str, Any]]]:
    from raypipe.data.pipeline import run_prepare
    from raypipe.eval.evaluate import run_evaluation
    from raypipe.train.export import export_drafter

    def prepare() -> dict[str, Any]:
        return run_prepare(cfg.data)["counts"]

    def export() -> dict[str, Any]:
        doc = export_drafter(cfg)
        return {"drafter": doc["speculative_config"]["model"], "vllm_command": doc["vllm_command"]}

    def evaluate() -> dict[str, Any]:
        doc = run_evaluation(cfg)
        return {k: doc[k] for k in ("tau", "tau_method", "output", "plots", "disagreement")}

    return {"prepare": prepare, "train": lambda: train_stage(cfg), "export": export, "eval": evaluate}


def run_pipeline(cfg: RaypipeConfig) -> dict[str, dict[str, Any]]:
    """Run every stage not yet done for this config; returns each stage's summary."""
    log = StageLog(cfg)
    summaries = {}
    for stage, run in _stages(cfg).items():
        record = log.done(stage)
        if record is not None:
            logger("pipeline").info(f"{stage}: done earlier with this config, skipped")
            summaries[stage] = record["summary"]
            continue
        logger("pipeline").info(f"{stage}: running")
        start = time.perf_counter()
        summaries[stage] = run()
        seconds = time.perf_counter() - start
        log.mark(stage, seconds, summaries[stage])
        logger("pipeline").info(f"{stage}: done in {seconds:.0f} s")
    return summaries
