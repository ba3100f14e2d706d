"""The whole run as one job: prepare -> replies -> hidden-state service + train -> export -> evaluate.

Each stage records its completion in `{train.output}/pipeline/{name}/{stage}.json`
(per run name) with a fingerprint of what its output depends on, so a
re-submitted job skips the stages already done for the same inputs and resumes
the interrupted one (the data stage skips completed shards, Ray Train restores
the run from its last checkpoint). Fingerprints come from content and chain
stage to stage: prepare's covers the data config, the tokenizer, the template's
text, each input file's size plus ETag or mtime (sha256 inside a job's working-dir
package) and the raypipe version;
train's covers the digest of the manifest prepare wrote (every shard's
checksum), the train and serve config, the target's digest
(raypipe.target.target_digest: its weights, updated in place or not) and the
raypipe version; replies' covers the manifest's digest and what the replies are
made with (the target and its digest, the reply settings); export's is train's,
and eval's chains on it with the eval config, the content of the prompts it
reads and the raypipe version. Each stage returns a typed result (`Prepared`,
`Replied`, `Trained`, `Exported`, `Evaluated`), recorded as its summary. A
change re-runs the stages it affects; where the old output cannot be reused
safely, the stage refuses with a message instead (a changed input under the
same data.output, a changed train config or target under the same run name). A
record of another shape (an older raypipe's fingerprint) matches nothing: its
stage runs again, resuming what it finds done. Credentials in storage_options
are redacted before hashing, so rotating one re-runs nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import raypipe
from raypipe.config import DataConfig, RaypipeConfig, fingerprint, trained_settings
from raypipe.console import logger
from raypipe.layout import RunFolders
from raypipe.storage import Storage
from raypipe.target import target_digest


def prepare_fingerprint(cfg: DataConfig) -> str:
    """The data config (redacted; data.output and parallelism included: a resume is cheap) and what the rows depend
    on."""
    from raypipe.data.output import dependencies
    from raypipe.data.tokenizer import resolve_tokenizer

    _, spec = resolve_tokenizer(cfg)
    return fingerprint({"data": cfg.public_dump(), "dependencies": dependencies(cfg, spec)})


def train_fingerprint(cfg: RaypipeConfig, manifest_sha256: str, target: str) -> str:
    """The prepared data by content (the manifest's digest covers every shard's checksum), what the drafter is
    trained on and with (raypipe.config.trained_settings, as the resume check compares), the target's digest
    (`target`, raypipe.target.target_digest) and the raypipe version that trains. How the run executes (workers,
    resources, intervals, where states come from) changes no drafter, so it re-runs nothing. With τ measured during
    training, what it measures joins: it picks the checkpoint exported and may stop the run."""
    return fingerprint(
        {
            "manifest_sha256": manifest_sha256,
            "target_digest": target,
            "raypipe_version": raypipe.__version__,
            **trained_settings(cfg.public_dump()),
            **({"tau_during_training": _measured_in_training(cfg)} if cfg.eval.every_steps else {}),
        }
    )


def _measured_in_training(cfg: RaypipeConfig) -> dict[str, Any]:
    from raypipe.eval.prompts import prompts_digest

    e = cfg.eval
    probe = cfg.model_copy(update={"eval": e.model_copy(update={"num_prompts": min(e.probe_prompts, e.num_prompts)})})
    settings = ("every_steps", "probe_prompts", "temperatures", "max_tokens", "min_tau", "patience")
    return {"eval": {k: getattr(e, k) for k in settings}, "prompts": prompts_digest(probe)}


def replies_fingerprint(cfg: RaypipeConfig, manifest_sha256: str, target: str) -> str:
    """The prepared data by content and what the replies are made with: the target (serve's content and the target's
    digest, `target`) and `train.replies`."""
    settings = trained_settings(cfg.public_dump())
    made_with = {k: v for k, v in settings.items() if k.startswith(("serve.", "train.replies."))}
    return fingerprint({"manifest_sha256": manifest_sha256, "target_digest": target, **made_with})


def eval_fingerprint(cfg: RaypipeConfig, trained: str) -> str:
    """The trained (and exported) drafter's fingerprint, the eval config, the content of the prompts it reads
    (`eval.prompts` names a file, which may change in place) and the raypipe version that measures."""
    from raypipe.eval.prompts import prompts_digest

    return fingerprint(
        {
            "train": trained,
            "eval": cfg.eval.public_dump(),
            "prompts": prompts_digest(cfg),
            "raypipe_version": raypipe.__version__,
        }
    )


class StageLog:
    """Completion records of the stages of one run."""

    def __init__(self, cfg: RaypipeConfig) -> None:
        self.cfg = cfg
        self.storage = RunFolders.of(cfg).stages
        self._fingerprints: dict[str, str] = {}

    @functools.cached_property
    def manifest_sha256(self) -> str:
        """The digest of the manifest the prepare stage wrote, read once: replies' and train's fingerprints chain on
        it."""
        from raypipe.data.output import PreparedOutput

        return PreparedOutput.of(self.cfg.data).manifest_sha256()

    @functools.cached_property
    def target_digest(self) -> str:
        """The target's digest, computed once: replies' and train's fingerprints cover it."""
        return target_digest(self.cfg.serve)

    def fingerprint(self, stage: str) -> str:
        """Computed when first asked, in stage order: replies' and train's hash the manifest the prepare stage wrote."""
        if stage not in self._fingerprints:
            cfg = self.cfg
            if stage == "prepare":
                fingerprint = prepare_fingerprint(cfg.data)
            elif stage == "replies":
                fingerprint = replies_fingerprint(cfg, self.manifest_sha256, self.target_digest)
            elif stage == "train":
                fingerprint = train_fingerprint(cfg, self.manifest_sha256, self.target_digest)
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


@dataclass(frozen=True)
class Prepared:
    rows_in: int
    rows_kept: int
    rows_rejected: int
    tokens: int
    needs_response: int
    manifest: str


@dataclass(frozen=True)
class Replied:
    shards: int  # shards whose replies this run generated (0: all were stored)
    replies: int
    tokens: int


@dataclass(frozen=True)
class Trained:
    step: int
    epoch: int
    loss: float
    tau_estimate: float
    canary: str | None  # the service's canary verdict, None with train.states.mode=offline


@dataclass(frozen=True)
class Exported:
    drafter: str
    vllm_command: str


@dataclass(frozen=True)
class Evaluated:
    tau: float
    tau_method: str  # vllm, or offline_replay where vLLM refused the drafter
    output: str
    plots: list[str]
    disagreement: bool
    vllm_command: str | None  # with the K the evaluation chose (export.json rewritten), None where it chose none


Result = Prepared | Replied | Trained | Exported | Evaluated


def prepare_stage(cfg: RaypipeConfig) -> Prepared:
    from raypipe.data.output import PreparedOutput
    from raypipe.data.pipeline import run_prepare

    c = run_prepare(cfg.data)["counts"]
    keys = ("rows_in", "rows_kept", "rows_rejected", "tokens", "needs_response")
    return Prepared(**{k: c[k] for k in keys}, manifest=f"{PreparedOutput.of(cfg.data).url}/manifest.json")


def replies_stage(cfg: RaypipeConfig) -> Replied:
    """Before the service: the reply engines take the Serve GPUs, the training GPUs stay free."""
    from raypipe.train.replies import run_replies

    done = run_replies(cfg)
    return Replied(shards=done["shards"], replies=done["replies"], tokens=done["tokens"])


def _service_record(cfg: RaypipeConfig) -> str:
    """Under train.output: the service a job of this run deployed and has not deleted yet."""
    return f"service/{cfg.name}.json"


def _deployed_at() -> float | None:
    """When the running hidden-state service was deployed (Serve's own record), None if none is."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    return app.last_deployed_time_s if app is not None else None


def _inherited(root: Storage, record: str) -> bool:
    """The running service was deployed by an earlier job of this run (killed before it could delete it): deployed
    after that job recorded it was deploying one."""
    if not root.exists(record):
        return False
    deployed = _deployed_at()
    return deployed is not None and deployed >= root.read_json(record)["deploying_since"]


def train_stage(cfg: RaypipeConfig) -> Trained:
    """Training with the service up: started here unless one for this target already runs, and then stopped again,
    so that no replica holds its GPUs (and their nodes) after the run. A service that an earlier job of this run
    started is stopped too: that job was killed (or its driver died) before it could stop it."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME, attach_service, ensure_service
    from raypipe.train.launcher import run_training

    started, canary, root, record = False, None, RunFolders.of(cfg).root, _service_record(cfg)
    if cfg.train.states.mode != "offline":
        handle = attach_service(cfg.serve)  # checks a running service serves this target
        inherited = handle is not None and _inherited(root, record)
        started = handle is None or inherited
        logger("train").info(
            "starting the hidden-state service"
            if handle is None
            else f"attached to the hidden-state service{' an earlier job of this run started' if inherited else ''}"
        )
        if handle is None:
            root.write_json(record, {"deploying_since": time.time()})  # before: a job killed while deploying
            try:
                handle = ensure_service(cfg)
            except BaseException:
                root.fs.rm(root.path(record))  # none runs: a later service is not this run's
                raise
        canary = handle.stats.remote().result()["canary"]
        logger("train").info(f"service {canary or 'canary off'}")
    try:
        result = run_training(cfg)
    finally:
        if started:
            serve.delete(APP_NAME)  # its CPUs or GPUs go back to the evaluation (and the autoscaler)
            root.fs.rm(root.path(record))
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}")
    m = result.metrics
    return Trained(int(m["step"]), int(m["epoch"]), m["loss"], m["tau_estimate"], canary)


def export_stage(cfg: RaypipeConfig) -> Exported:
    from raypipe.train.export import export_drafter

    doc = export_drafter(cfg)
    return Exported(drafter=doc["speculative_config"]["model"], vllm_command=doc["vllm_command"])


def eval_stage(cfg: RaypipeConfig) -> Evaluated:
    from raypipe.eval.evaluate import run_evaluation

    doc = run_evaluation(cfg)
    return Evaluated(**{k: doc[k] for k in ("tau", "tau_method", "output", "plots", "disagreement", "vllm_command")})


STAGES: dict[str, tuple[Callable[[RaypipeConfig], Result], type[Result]]] = {
    "prepare": (prepare_stage, Prepared),
    "replies": (replies_stage, Replied),
    "train": (train_stage, Trained),
    "export": (export_stage, Exported),
    "eval": (eval_stage, Evaluated),
}


def _recorded(kind: type[Result], summary: Any) -> Result | None:
    """A stage's result from its record; None for a record of another shape (an older raypipe's): the stage runs
    again, resuming what it finds done."""
    names = {f.name for f in fields(kind)}
    return kind(**summary) if isinstance(summary, dict) and set(summary) == names else None


def run_pipeline(cfg: RaypipeConfig) -> dict[str, Result]:
    """Run every stage not yet done for this config; returns each stage's result."""
    log = StageLog(cfg)
    results: dict[str, Result] = {}
    for stage, (run, kind) in STAGES.items():
        record = log.done(stage)
        earlier = _recorded(kind, record["summary"]) if record is not None else None
        if earlier is not None:
            logger("pipeline").info(f"{stage}: done earlier with this config, skipped")
            results[stage] = earlier
            continue
        logger("pipeline").info(f"{stage}: running")
        start = time.perf_counter()
        results[stage] = run(cfg)
        seconds = time.perf_counter() - start
        log.mark(stage, seconds, asdict(results[stage]))
        logger("pipeline").info(f"{stage}: done in {seconds:.0f} s")
    return results
