"""`train.*` in sections: what the drafter trains on and with (content), how the run executes (execution)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raypipe.config.base import CONTENT, EXECUTION, LOSSES, _Strict, content_fields
from raypipe.config.serve import ServeConfig


class DrafterConfig(_Strict):
    """The DFlash drafter's shape (its width, heads and rope come from the target)."""

    draft_layers: int = Field(default=5, gt=0, description="Decoder layers of the drafter.")
    block_size: int = Field(
        default=16, ge=2, description="Tokens per draft block (the drafter proposes block_size - 1)."
    )
    mask_token_id: int | None = Field(
        default=None,
        description="Mask token of the draft blocks; default: the tokenizer's, else the first unused id of the "
        "target's vocabulary.",
    )
    draft_vocab_size: int | None = Field(
        default=None,
        gt=0,
        description="Draft vocabulary: the drafter's LM head keeps this many of the target's tokens, the most "
        "frequent supervised ones of the run (raypipe.train.vocab); default: the target's whole vocabulary.",
    )


class ObjectiveConfig(_Strict):
    """What each step learns: the loss over the draft positions of random anchors."""

    loss: str | dict[str, float] = Field(
        default="ce",
        description="Loss of each drafted position against the target's: a name (" + ", ".join(LOSSES) + ") or a "
        "weighted mix, e.g. {ce: 0.1, tv: 0.9} (speculators' losses).",
    )
    position_weighting: Literal["dpace", "exp_decay"] = Field(
        default="dpace",
        description="Weights of the positions of a draft block: dpace (D-PACE: by the drafter's own running "
        "confidence, speculators' DFlash default; needs loss ce) or exp_decay (exp(-(k-1)/loss_decay_gamma)).",
    )
    dpace_alpha: float = Field(default=0.5, gt=0, le=1, description="D-PACE's confidence smoothing, in (0, 1].")
    loss_decay_gamma: float = Field(
        default=7.0, gt=0, description="exp_decay's decay length in positions (7 at block 16 in the DFlash paper)."
    )
    max_anchors: int = Field(
        default=512,
        gt=0,
        description="Random anchor positions (draft blocks) per row, as the DFlash paper's 512 per sequence; a row "
        "with fewer supervised positions anchors every one.",
    )
    max_pack_anchors: int = Field(
        default=1024,
        gt=0,
        description="Cap on the anchors of one packed sequence (memory: the step holds anchors x block_size x "
        "vocabulary logits, twice); above it the pack's anchors are a uniform sample of its rows'.",
    )

    @field_validator("loss")
    @classmethod
    def _known_losses(cls, value: str | dict[str, float]) -> str | dict[str, float]:
        names = [value] if isinstance(value, str) else list(value)
        unknown = [n for n in names if n not in LOSSES]
        if unknown or not names:
            raise ValueError(f"unknown loss {unknown or value!r}: give one of {', '.join(LOSSES)} or a mix of them")
        return value

    @model_validator(mode="after")
    def _dpace_needs_ce(self) -> ObjectiveConfig:
        if self.position_weighting == "dpace" and self.loss != "ce":
            raise ValueError(
                f"train.objective.position_weighting=dpace weighs positions by the drafter's confidence, read from "
                f"the cross-entropy: it needs train.objective.loss=ce (got {self.loss!r}); or set "
                "train.objective.position_weighting=exp_decay"
            )
        return self


class OptimConfig(_Strict):
    """AdamW and its schedule: linear warm-up, then cosine to zero."""

    lr: float = Field(default=6e-4, gt=0, description="Peak AdamW learning rate.")
    warmup_ratio: float = Field(
        default=0.04, ge=0, lt=1, description="Share of the steps spent warming up linearly before the cosine decay."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Gradient norm clip.")


class ScheduleConfig(_Strict):
    """Which rows each step trains on, in which order, for how long."""

    epochs: int = Field(default=6, gt=0, description="Passes over the prepared data.")
    max_steps: int | None = Field(
        default=None,
        gt=0,
        description="Stop after this many optimizer steps (short runs, benchmarks); default: all epochs.",
    )
    step_tokens: int = Field(default=8192, gt=0, description="Token budget of one packed sequence per worker and step.")
    shuffle_window: int = Field(
        default=4, gt=0, description="Prepared shards whose rows are shuffled together (a window is read at a time)."
    )
    seed: int = Field(
        default=0, description="Seeds the data order (per epoch), anchors, initialisation and sampled replies."
    )


class RepliesConfig(_Strict):
    """The target's own replies to needs_response rows, generated before training (the reply pass)."""

    temperature: float = Field(
        default=0.0,
        ge=0,
        description="Sampling temperature of on-policy replies for needs_response rows; above 0 each row's reply is "
        "seeded by train.schedule.seed and the row's position, so it is the same in any batch and after a restart.",
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Nucleus sampling of on-policy replies (vLLM's top_p); 1.0 keeps the whole distribution.",
    )
    max_tokens: int = Field(default=1024, gt=0, description="Longest on-policy reply.")


class StatesConfig(_Strict):
    """Where the target's hidden states come from; any source gives the same states."""

    mode: Literal["online", "offline", "hybrid"] = Field(
        default="online",
        description="From the service (nothing stored), from the cache only, or cache hit else the service.",
    )
    cache: str | None = Field(default=None, description="Hidden-state cache URL (offline, hybrid).")
    store_misses: bool = Field(
        default=True, description="In hybrid mode, store states fetched from the service in the cache."
    )
    prefetch: int = Field(
        default=4, gt=0, description="Steps whose hidden states are requested ahead of the step that needs them."
    )


class RunConfig(_Strict):
    """How the run executes: workers, resources, parallelism, intervals and fault limits."""

    num_workers: int = Field(default=8, gt=0, description="Ray Train workers (one GPU each on GPU).")
    use_gpu: bool = Field(default=True, description="Train on GPUs (NCCL, bf16 autocast) or on CPUs (gloo, fp32).")
    cpus_per_worker: float = Field(
        default=1.0,
        gt=0,
        description="Logical CPUs per worker; fractional on small CPU machines so Ray Data is not starved.",
    )
    resource: str | None = Field(
        default="train_gpu",
        description="Custom resource each worker takes one unit of: it places them on the Train node type, apart from "
        "Serve GPUs.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="Placement group strategy of the workers."
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        default="ddp", description="Data parallelism: DDP replicas, or FSDP2 sharding for large drafters."
    )
    attention: Literal["auto", "sdpa", "eager", "simple_flex_attention"] = Field(
        default="auto",
        description="Drafter attention; auto: flex attention on GPU, sdpa on CPU (flex has no CPU backward).",
    )
    reply_max_sequences: int = Field(
        default=256, gt=0, description="Sequences one engine of the reply pass generates at once (continuous batching)."
    )
    reply_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="Longest an engine of the reply pass may take to start, or to reply to one shard, before the pass "
        "fails naming it.",
    )
    log_every: int = Field(
        default=10,
        gt=0,
        description="Steps between metric reductions (one collective and one host sync each), progress lines and "
        "metric updates.",
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default=["tensorboard"],
        description="Experiment trackers fed from rank 0 with the logged metrics and, once, the config (redacted): "
        "tensorboard (event files in the run's tensorboard/{name}/), wandb and mlflow (`pip install "
        "raypipe[trackers]`; set up by their WANDB_* and MLFLOW_* variables, offline modes included; see "
        "raypipe/train/trackers.py).",
    )
    checkpoint_every: int = Field(
        default=500, gt=0, description="Steps between checkpoints (also at each epoch end and the end)."
    )
    keep_checkpoints: int = Field(
        default=2,
        gt=0,
        description="Checkpoints kept by score (lowest mean training loss of their interval; export takes the best), "
        "beside the latest, always kept.",
    )
    max_failures: int = Field(
        default=3, ge=0, description="Worker-group restarts from the last checkpoint before the run fails."
    )
    max_nonfinite_steps: int = Field(
        default=8,
        gt=0,
        description="Consecutive steps skipped for a NaN or Inf loss or gradient norm after which the run stops "
        "(checked at each log).",
    )


class TrainConfig(_Strict):
    """Stage 3: the DFlash drafter trained on Ray Train workers, fed by the service (defaults: the DFlash paper).

    Its sections are content (what it trains: in the fingerprints and the resume check) or execution (how the run
    executes: may change on a resume), by their `role`."""

    output: str = Field(
        json_schema_extra=EXECUTION,
        description="Run directory (local or URL, s3:// included): checkpoints, replies, ledger, export.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra=EXECUTION,
        description="fsspec options for an output URL, as data.storage_options.",
    )
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, json_schema_extra=CONTENT)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig, json_schema_extra=CONTENT)
    optim: OptimConfig = Field(default_factory=OptimConfig, json_schema_extra=CONTENT)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, json_schema_extra=CONTENT)
    replies: RepliesConfig = Field(default_factory=RepliesConfig, json_schema_extra=CONTENT)
    states: StatesConfig = Field(default_factory=StatesConfig, json_schema_extra=EXECUTION)
    run: RunConfig = Field(default_factory=RunConfig, json_schema_extra=EXECUTION)


def trained_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What a drafter is trained on and with, by dotted key, from a dumped config (the run's, or a checkpoint's saved
    config.json): the content fields of `serve` (the target, its layers, the dtype) and of `train`'s sections. The
    train stage's fingerprint and the resume check both compare these; execution fields may change on a resume."""
    serve = {f"serve.{key}": config["serve"].get(key) for key in content_fields(ServeConfig)}
    train = {
        f"train.{section}.{key}": value
        for section in content_fields(TrainConfig)
        for key, value in config["train"].get(section, {}).items()
    }
    return {**serve, **train}
