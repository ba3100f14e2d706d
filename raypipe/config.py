"""The one typed config of a raypipe run: a root model made of stage sub-configs.

A run is described by a YAML recipe (a file, or the name of one shipped in
`raypipe/recipes/`) plus `key=value` overrides. Everything is validated before
any work starts, and errors name the field and what it accepts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

RECIPES_DIR = Path(__file__).parent / "recipes"
REDACTED = "<redacted>"
# speculators' per-position losses (speculators.losses.resolve_loss_config), by the names it takes.
LOSSES = ("ce", "kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid")
# Names of fsspec options that carry credentials (s3fs key/secret/token, client_kwargs' aws_*_key*, gcsfs token,
# adlfs account_key/sas_token/connection_string, HTTP headers' Authorization, passwords), matched as substrings.
_SECRET_NAMES = ("key", "secret", "token", "password", "passwd", "credential", "auth", "signature", "connection_string")


def fingerprint(doc: Any) -> str:
    """The one digest of raypipe's fingerprints (output hashes, the pipeline's stages, the tokenizer and template):
    the first 16 hex digits of the sha256 of `doc` as canonical JSON (sorted keys, str() for what JSON lacks), or of
    a string's own text."""
    text = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def redact(doc: Any) -> Any:
    """A copy of a config dump with every credential under `storage_options` replaced by a constant.

    What is persisted, hashed, logged or shown goes through this (so a rotated secret changes no fingerprint,
    while an endpoint still does); what workers use is the real config.
    """
    return _redact(doc, False)


def _redact(doc: Any, options: bool) -> Any:
    if isinstance(doc, dict):
        return {
            k: REDACTED
            if options and any(n in str(k).lower() for n in _SECRET_NAMES)
            else _redact(v, options or k == "storage_options")
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_redact(v, options) for v in doc]
    return doc


class _Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def public_dump(self, **kwargs: Any) -> dict[str, Any]:
        """model_dump(**kwargs) with credentials redacted: the form to persist, hash, log or show."""
        return redact(self.model_dump(**kwargs))


CONTENT: dict[str, Any] = {"role": "content"}
EXECUTION: dict[str, Any] = {"role": "execution"}


def role(field: FieldInfo) -> str | None:
    """A field's role: `content` (changes what a stage produces: in its fingerprints and resume checks) or
    `execution` (how it runs: parallelism, resources, places, intervals; may change on a resume)."""
    extra = field.json_schema_extra
    return extra.get("role") if isinstance(extra, dict) else None


def content_fields(model: type[BaseModel]) -> list[str]:
    """The names of a config model's content fields."""
    return [name for name, field in model.model_fields.items() if role(field) == "content"]


def content_dump(model: BaseModel) -> dict[str, Any]:
    """The model's content fields, dumped: what its fingerprints cover."""
    return model.model_dump(include=set(content_fields(type(model))))


class SourceConfig(_Strict):
    """One input dataset: a path or glob on any fsspec filesystem."""

    path: str = Field(description="Local path, glob or URL (s3://, gs://) of JSONL, JSONL.gz or Parquet files.")
    name: str | None = Field(
        default=None, description="Dataset name written to the `source` column; default: the file stem of the glob."
    )
    format: Literal["auto", "openai", "sharegpt", "alpaca"] = Field(
        default="auto", description="Input format; `auto` detects it per row from its keys."
    )

    @property
    def source_name(self) -> str:
        """The name, else the last path component that is not a glob, without suffixes."""
        if self.name:
            return self.name
        parts = [p for p in self.path.split("://")[-1].rstrip("/").split("/") if p and not any(c in p for c in "*?[")]
        return parts[-1].split(".")[0] if parts else "data"


class DataConfig(_Strict):
    """Stage 1: raw conversations to token rows with assistant masks."""

    sources: list[SourceConfig] = Field(json_schema_extra=CONTENT, min_length=1, description="Input datasets.")
    output: str = Field(
        json_schema_extra=EXECUTION,
        description="Output directory (local or URL) for shards, manifest.json and rejects/.",
    )
    storage_options: dict[str, Any] = Field(
        json_schema_extra=EXECUTION,
        default_factory=dict,
        description="fsspec options for URLs, e.g. {client_kwargs: {endpoint_url: ...}} for S3.",
    )
    tokenizer: str = Field(
        json_schema_extra=CONTENT,
        description="`builtin:qwen` (Qwen vocabulary built locally), `builtin:demo` (the demo target's) or a path / "
        "Hugging Face id.",
    )
    chat_template: str | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="Builtin template name (qwen_strict, generation_markers, chatml) or a .jinja path; default: the "
        "tokenizer's own.",
    )
    enable_thinking: bool = Field(
        json_schema_extra=CONTENT,
        default=False,
        description="Passed to the template; with false the generation prompt ends in an empty think block.",
    )
    end_of_turn: str | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="The special token that ends an assistant turn (supervised, and where replies stop); default: "
        "probed from the template, never the tokenizer's eos.",
    )
    placeholder_reply: str = Field(
        json_schema_extra=CONTENT,
        default="OK.",
        min_length=1,
        description="Text of the injected placeholder reply; never trained on.",
    )
    max_length: int = Field(json_schema_extra=CONTENT, default=3072, gt=0, description="Maximum tokens per row.")
    overlength: Literal["truncate", "reject"] = Field(
        json_schema_extra=CONTENT,
        default="truncate",
        description="Rows over max_length: keep the first max_length tokens, or reject the row.",
    )
    max_row_bytes: int = Field(
        json_schema_extra=CONTENT,
        default=8 << 20,
        gt=0,
        description="Raw input rows larger than this are rejected unparsed.",
    )
    chunk_bytes: int = Field(
        json_schema_extra=CONTENT,
        default=16 << 20,
        gt=0,
        description="Most input bytes per output shard (JSONL, gzip by decompressed bytes, Parquet by row groups, "
        "never cut): large files are cut into shards, small files of one source share one; a smaller input is cut "
        "finer, so that each actor has 4 shards (at least 256 KiB each).",
    )
    batch_rows: int = Field(
        json_schema_extra=EXECUTION, default=1024, gt=0, description="Rows per batched tokenizer call."
    )
    num_actors: int = Field(
        json_schema_extra=EXECUTION, default=2, gt=0, description="CPU actors that prepare shards in parallel."
    )
    cpus_per_actor: float = Field(
        json_schema_extra=EXECUTION, default=1.0, gt=0, description="Logical CPUs reserved per actor."
    )

    def output_hash(self) -> str:
        """Hash of the content fields (what changes the prepared rows; not where they go or the parallelism)."""
        return fingerprint(content_dump(self))


class ServeConfig(_Strict):
    """Stage 2: the hidden-state service (Ray Serve replicas hosting the target). Its content fields (the target, its
    layers, the dtype) decide the states a drafter trains on; the rest is how the service runs."""

    engine: Literal["vllm", "transformers"] = Field(
        json_schema_extra=EXECUTION, default="vllm", description="vLLM (production) or transformers (reference)."
    )
    model: str = Field(
        json_schema_extra=CONTENT,
        description="The target: `builtin:tiny` (tiny random Qwen3), `builtin:tiny_qwen36` (tiny random Qwen3.6 "
        "architecture), `builtin:demo` and `builtin:demo_qwen36` (the same two architectures trained on structured "
        "chat), all built locally, or a path / Hugging Face id.",
    )
    layer_ids: list[int] | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="Layer ids to serve (vLLM's convention, see raypipe/target.py); default: DFlash's five aux "
        "layers and the last.",
    )
    dtype: str = Field(json_schema_extra=CONTENT, default="auto", description="Engine dtype (auto, bfloat16, float32).")
    max_model_len: int = Field(
        json_schema_extra=EXECUTION,
        default=4096,
        gt=0,
        description="vLLM's context: a request's tokens plus those it generates. Must exceed data.max_length (vLLM "
        "needs room for one generated token after a row), so the longest sequence a request may carry is "
        "max_model_len - 1.",
    )
    max_sequences: int = Field(
        json_schema_extra=EXECUTION, default=64, gt=0, description="Most sequences in one request."
    )
    max_batch_tokens: int = Field(
        json_schema_extra=EXECUTION,
        default=16384,
        gt=0,
        description="Most tokens in one request (the engine batches requests continuously).",
    )
    tensor_parallel_size: int = Field(
        json_schema_extra=EXECUTION, default=1, gt=0, description="vLLM tensor parallelism per replica."
    )
    gpu_memory_utilization: float = Field(
        json_schema_extra=EXECUTION,
        default=0.9,
        gt=0,
        le=1,
        description="vLLM's share of each GPU's memory (GPUs only; on CPU set kv_cache_gib).",
    )
    kv_cache_gib: float | None = Field(
        json_schema_extra=EXECUTION,
        default=None,
        gt=0,
        description="vLLM's KV cache per engine in GiB, instead of gpu_memory_utilization. Required on CPU (num_gpus: "
        "0), where a "
        "utilization is a share of one NUMA node's memory, minus the engine's own RSS.",
    )
    enforce_eager: bool = Field(
        json_schema_extra=EXECUTION, default=False, description="Disable CUDA graphs (required on CPU)."
    )
    num_gpus: float = Field(
        json_schema_extra=EXECUTION,
        default=1.0,
        ge=0,
        description="GPUs per replica (tensor_parallel_size for vLLM on GPUs).",
    )
    num_cpus: float = Field(json_schema_extra=EXECUTION, default=1.0, gt=0, description="CPUs per replica.")
    resource: str | None = Field(
        json_schema_extra=EXECUTION,
        default="serve_gpu",
        description="Custom resource each replica (and evaluation engine) takes, one unit per GPU (one without GPUs): "
        "it places them on the Serve node type, apart from Train GPUs.",
    )
    min_replicas: int = Field(json_schema_extra=EXECUTION, default=1, ge=0, description="Autoscaling lower bound.")
    max_replicas: int = Field(json_schema_extra=EXECUTION, default=1, gt=0, description="Autoscaling upper bound.")
    target_ongoing_requests: float = Field(
        json_schema_extra=EXECUTION,
        default=4,
        gt=0,
        description="Autoscaling target per replica: trainers waiting for states raise the backlog, and replicas are "
        "added.",
    )
    upscale_delay_s: float = Field(
        json_schema_extra=EXECUTION,
        default=30.0,
        ge=0,
        description="Backlog above target this long before a replica is added.",
    )
    downscale_delay_s: float = Field(
        json_schema_extra=EXECUTION,
        default=600.0,
        ge=0,
        description="Backlog below target this long before a replica is removed.",
    )
    max_ongoing_requests: int = Field(
        json_schema_extra=EXECUTION, default=32, gt=0, description="Requests a replica accepts at once."
    )
    canary: Literal["refuse", "warn", "off"] = Field(
        json_schema_extra=EXECUTION,
        default="refuse",
        description="Parity canary against transformers at start-up: refuse to serve on mismatch, only warn, or skip.",
    )
    http_host: str = Field(
        json_schema_extra=EXECUTION,
        default="127.0.0.1",
        description="HTTP ingress host (health, canary, stats); loopback unless set.",
    )
    http_port: int = Field(json_schema_extra=EXECUTION, default=8000, gt=0, lt=65536, description="HTTP ingress port.")

    @model_validator(mode="after")
    def _kv_cache_on_cpu(self) -> ServeConfig:
        if self.engine == "vllm" and self.num_gpus == 0 and self.kv_cache_gib is None:
            raise ValueError(
                "serve.kv_cache_gib: set the KV cache size in GiB for vLLM on CPU (num_gpus: 0), e.g. "
                "serve.kv_cache_gib=1; "
                "a gpu_memory_utilization there is a share of one NUMA node's memory and fails on small nodes"
            )
        return self


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
    seed: int = Field(default=0, description="Seeds the data order (per epoch), anchors and initialisation.")


class RepliesConfig(_Strict):
    """The target's own replies to needs_response rows, generated before training (the reply pass)."""

    temperature: float = Field(
        default=0.0, ge=0, description="Sampling temperature of on-policy replies for needs_response rows."
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


class EvalConfig(_Strict):
    """Stage 4: acceptance of the exported drafter measured in vLLM, beside the offline and training estimates."""

    prompts: str = Field(
        description="Held-out conversations (JSONL, any data.sources format, local or URL); a trailing assistant turn "
        "is dropped, the rest is the prompt."
    )
    num_prompts: int = Field(default=100, gt=0, description="Prompts evaluated (the first ones of the file).")
    max_tokens: int = Field(default=256, gt=0, description="Longest generated reply.")
    temperatures: list[float] = Field(
        default=[0.0, 1.0],
        min_length=1,
        description="Sampling temperatures measured; the offline replay replays vLLM's replies at each.",
    )
    concurrency: list[int] = Field(
        default=[1, 4, 16],
        description="Concurrent clients of the latency sweep (TTFT, TPOT, tokens/s, τ per level) through vLLM's "
        "OpenAI-compatible server, with and without the drafter, at temperature 0; [] skips the sweep.",
    )
    latency_prompts: int = Field(
        default=48, gt=0, description="Prompts each level of the latency sweep sends (the first eval prompts)."
    )
    threshold: float = Field(
        default=0.15,
        gt=0,
        description="Relative gap between an estimate and vLLM's τ (temperature 0) above which the report flags a "
        "disagreement.",
    )
    output: str | None = Field(
        default=None, description="Report directory (local or URL): eval.json and plots; default: {train.output}/eval."
    )

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if any(c < 1 for c in value):
            raise ValueError(f"concurrency levels must be >= 1, got {value}")
        return value

    @field_validator("temperatures")
    @classmethod
    def _greedy_first(cls, value: list[float]) -> list[float]:
        if 0.0 not in value:
            raise ValueError("must include 0.0: vLLM's greedy τ is what the estimates are compared with")
        if any(t < 0 for t in value):
            raise ValueError(f"temperatures must be >= 0, got {value}")
        return value


class RaypipeConfig(_Strict):
    """Root config of one run."""

    name: str = Field(description="Run name, used in logs and metrics.")
    data: DataConfig
    serve: ServeConfig
    train: TrainConfig
    eval: EvalConfig

    @model_validator(mode="after")
    def _consistent(self) -> RaypipeConfig:
        if self.data.max_length > self.train.schedule.step_tokens:
            raise ValueError(
                f"train.schedule.step_tokens ({self.train.schedule.step_tokens}) must hold the longest row, "
                f"data.max_length ({self.data.max_length})"
            )
        if self.data.max_length >= self.serve.max_model_len:
            raise ValueError(
                f"serve.max_model_len ({self.serve.max_model_len}) must exceed data.max_length "
                f"({self.data.max_length}): rows of up to data.max_length tokens go to vLLM for their hidden "
                "states, and vLLM refuses a prompt that leaves no room for one generated token. Set "
                f"serve.max_model_len={self.data.max_length + 1} or more (the shipped recipes give it "
                "data.max_length + 1024, room for the evaluation's replies too)"
            )
        if self.train.states.mode != "online" and not self.train.states.cache:
            raise ValueError(f"train.states.cache: give a cache URL for train.states.mode={self.train.states.mode}")
        return self


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` in nested dicts/lists, creating dicts where a key is missing."""
    keys = dotted.split(".")
    node: Any = tree
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ValueError(
                    f"override {dotted!r}: {'.'.join(keys[:i]) or 'root'} is a list of {len(node)}, {key!r} is not an "
                    "index in it"
                )
            key = int(key)
        elif not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and key not in node:
                node[key] = {}
            node = node[key]


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key=value` pairs; values are YAML so `data.max_length=4096` is an int."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value, e.g. data.max_length=4096")
        pairs.append((key.strip(), _override_value(item, raw)))
    return pairs


def _override_value(item: str, raw: str) -> Any:
    """The override's value as YAML, or one line naming the override and YAML's complaint."""
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(
            f"override {item!r} is not valid YAML ({problem}); quote it for the shell and complete it, e.g. "
            "'data.sources=[{path: data/x.jsonl}]'"
        ) from None


def recipe_path(recipe: str) -> Path:
    """A recipe is a YAML file path or the name of a shipped recipe."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    shipped = RECIPES_DIR / f"{recipe}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ValueError(f"unknown recipe {recipe!r}: give a .yaml file or one of {', '.join(names)}")


def load_config(recipe: str, overrides: list[str] = ()) -> RaypipeConfig:
    """Recipe + overrides -> validated config; a ValueError names every bad field."""
    path = recipe_path(recipe)
    tree = yaml.safe_load(path.read_text()) or {}
    for key, value in parse_overrides(list(overrides)):
        _set_path(tree, key, value)
    try:
        return RaypipeConfig.model_validate(tree)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"]) or "root"
            got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
            lines.append(f"  {field}: {e['msg']}{got}")
        raise ValueError(f"invalid config from {path.name}:\n" + "\n".join(lines)) from None
