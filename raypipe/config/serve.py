"""`serve.*`: the target and the vLLM engines of the hidden-state service (and of the replies and evaluation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raypipe.config.base import CONTENT, EXECUTION, _Strict

# vLLM engine arguments raypipe sets itself, and the setting (or reason) that owns each.
OWNED_ENGINE_ARGS = {
    "model": "serve.model",
    "tokenizer": "serve.model (its tokenizer)",
    "dtype": "serve.dtype",
    "max_model_len": "serve.max_model_len",
    "max_num_seqs": "serve.max_sequences (train.run.reply_max_sequences for the replies)",
    "tensor_parallel_size": "serve.tensor_parallel_size",
    "enforce_eager": "serve.enforce_eager",
    "kv_cache_memory_bytes": "serve.kv_cache_gib",
    "gpu_memory_utilization": "serve.gpu_memory_utilization",
    "enable_prefix_caching": "raypipe (off: no prefix is reused, and hybrid targets need it off)",
    "disable_log_stats": "raypipe (the spec-decode counters the evaluation reads)",
    "use_tqdm_on_load": "raypipe (the console)",
    "seed": "raypipe (replies and evaluation are seeded)",
    "limit_mm_per_prompt": "raypipe (text only)",
    "speculative_config": "raypipe (per engine: extraction, the drafter)",
    "kv_transfer_config": "raypipe (the hidden-state connector)",
    "enable_chunked_prefill": "raypipe (on in the service, off in sampling reply engines)",
    "distributed_executor_backend": "raypipe (uni on one GPU, mp with tensor parallelism)",
}


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
        json_schema_extra=EXECUTION,
        default=False,
        description="vLLM's eager mode in every engine: no CUDA graphs and no torch.compile (set it on CPU). The "
        "hidden-state service captures no CUDA graphs either way (it only prefills) and keeps torch.compile unless "
        "this is set.",
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

    engine_kwargs: dict[str, Any] | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="More vLLM engine arguments (vllm.EngineArgs names, e.g. max_num_batched_tokens, "
        "kv_cache_dtype), for every engine raypipe starts: the service, the replies, the evaluation and its latency "
        "server. Content: some change the hidden states (quantization, kv_cache_dtype). Keys raypipe sets are refused, "
        "naming the setting that owns them.",
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _not_owned(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        owned = [key for key in value or {} if key in OWNED_ENGINE_ARGS]
        if owned:
            raise ValueError("; ".join(f"{key}: raypipe sets it, use {OWNED_ENGINE_ARGS[key]}" for key in owned))
        return value

    @model_validator(mode="after")
    def _kv_cache_on_cpu(self) -> ServeConfig:
        if self.engine == "vllm" and self.num_gpus == 0 and self.kv_cache_gib is None:
            raise ValueError(
                "serve.kv_cache_gib: set the KV cache size in GiB for vLLM on CPU (num_gpus: 0), e.g. "
                "serve.kv_cache_gib=1; "
                "a gpu_memory_utilization there is a share of one NUMA node's memory and fails on small nodes"
            )
        return self
