"""The whole run as one job: prepare -> hidden-state service -> train -> export -> evaluate.

Each stage records its completion in `{train.output}/pipeline/{stage}.json`
with a fingerprint of the config it depends on, so a re-submitted job skips
the stages already done for the same config and resumes the interrupted one
(the data stage skips completed shards, Ray Train restores the run from its
last checkpoint). A changed config re-runs the stages it affects.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from raypipe.config import RaypipeConfig
from raypipe.storage import Storage, absolute

STAGES = ("prepare", "train", "export", "eval")


def fingerprints(cfg: RaypipeConfig) -> dict[str, str]:
    """Per stage, a hash of the settings its output depends on (parallelism included: it is cheap to resume)."""
    def digest(doc: Any) -> str:
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]

    trained = digest(cfg.model_dump(exclude={"eval"}))
    return {"prepare": cfg.data.output_hash(), "train": trained, "export": trained, "eval": digest(cfg.model_dump())}


class StageLog:
    """Completion records of the stages of one run."""

    def __init__(self, cfg: RaypipeConfig) -> None:
        self.storage = Storage(absolute(f"{cfg.train.output}/pipeline"), cfg.train.storage_options)
        self.fingerprints = fingerprints(cfg)

    def done(self, stage: str) -> dict[str, Any] | None:
        """The stage's record if it finished with the current config."""
        if not self.storage.exists(f"{stage}.json"):
            return None
        record = self.storage.read_json(f"{stage}.json")
        return record if record["fingerprint"] == self.fingerprints[stage] else None

    def mark(self, stage: str, seconds: float, summary: dict[str, Any]) -> None:
        self.storage.write_json(f"{stage}.json", {"stage": stage, "fingerprint": self.fingerprints[stage], "seconds": seconds, "summary": summary})


def _train(cfg: RaypipeConfig) -> dict[str, Any]:
    """Train with the service up (started here unless one for this target already runs; then stopped again)."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME, attach_service, ensure_service
    from raypipe.train.launcher import run_training
    from raypipe.train.replies import run_replies

    replies = run_replies(cfg)  # before the service: the reply engines take the Serve GPUs, the training GPUs stay free
    started, canary = False, None
    if cfg.train.hidden_states != "offline":
        handle = attach_service(cfg.serve)  # checks a running service serves this target
        started = handle is None
        print(f"[pipeline] {'starting' if started else 'attached to'} the hidden-state service", flush=True)
        if started:
            handle = ensure_service(cfg.serve)
        canary = handle.stats.remote().result()["canary"]
        print(f"[pipeline] service {canary or 'canary off'}", flush=True)
    try:
        result = run_training(cfg)
    finally:
        if started:
            serve.delete(APP_NAME)  # its CPUs or GPUs go back to the evaluation (and the autoscaler)
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}")
    return {"canary": canary, "replies": replies, **{k: result.metrics[k] for k in ("step", "epoch", "loss", "tau_estimate") if k in result.metrics}}


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

    return {"prepare": prepare, "train": lambda: _train(cfg), "export": export, "eval": evaluate}


def run_pipeline(cfg: RaypipeConfig) -> dict[str, dict[str, Any]]:
    """Run every stage not yet done for this config; returns each stage's summary."""
    log = StageLog(cfg)
    summaries = {}
    for stage, run in _stages(cfg).items():
        record = log.done(stage)
        if record is not None:
            print(f"[pipeline] {stage}: done earlier with this config, skipped", flush=True)
            summaries[stage] = record["summary"]
            continue
        print(f"[pipeline] {stage}: running", flush=True)
        start = time.perf_counter()
        summaries[stage] = run()
        seconds = time.perf_counter() - start
        log.mark(stage, seconds, summaries[stage])
        print(f"[pipeline] {stage}: done in {seconds:.0f} s", flush=True)
    return summaries
