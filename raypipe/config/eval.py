"""`eval.*`: how the drafter is measured in vLLM."""

from __future__ import annotations

from pydantic import Field, field_validator

from raypipe.config.base import _Strict


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
    k_concurrency: list[int] = Field(
        default=[1, 16],
        description="Concurrent clients at which the trained drafter's TPOT (tokens/s, τ) is measured at every "
        "num_speculative_tokens K = 1..block_size - 1, through vLLM's OpenAI server with eval.latency_prompts prompts "
        "(K = block_size - 1 reuses the latency sweep's levels in eval.concurrency); the K served (export.json, the "
        "printed vllm serve command) is the one whose worst TPOT ratio to each level's best is lowest "
        "(raypipe.eval.best_k); [] skips it and serves block_size - 1.",
    )
    threshold: float = Field(
        default=0.15,
        gt=0,
        description="Relative gap between an estimate and vLLM's τ (temperature 0) above which the report flags a "
        "disagreement.",
    )
    output: str | None = Field(
        default=None,
        description="Report directory (local or URL): eval.json and plots; default: {train.output}/eval/{name}.",
    )
    every_steps: int | None = Field(
        default=None,
        gt=0,
        description="Measure τ in vLLM during training every this many optimizer steps and at each checkpoint "
        "(raypipe.eval.probe): the current drafter's weights reloaded into a warm engine with the target, the first "
        "probe_prompts eval prompts at every eval.temperatures; checkpoints are then ranked by that τ at temperature 0 "
        "and export takes the highest. None: only after training.",
    )
    probe_prompts: int = Field(
        default=32, gt=0, description="Eval prompts (the first ones) each measurement during training generates."
    )
    min_tau: float | None = Field(
        default=None,
        ge=1,
        description="τ in vLLM (temperature 0) below which a run stops once it has been measured `patience` times: "
        "the drafter vLLM serves is not the one training improves. Default: the untrained drafter's τ (measured as "
        "the engine starts) + half the gain over it that the training estimates at that step, at least + 0.25 "
        "(raypipe.train.tau_rule).",
    )
    patience: int = Field(
        default=3, gt=0, description="Measurements during training before eval.min_tau can stop the run."
    )
    probe_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs of the engine that measures τ during training, on the Serve node type (serve.resource); "
        "default serve.num_gpus (a GPU of its own). A fraction time-shares a GPU with the hidden-state service: "
        "lower serve.gpu_memory_utilization so that both engines fit (the probe takes this fraction of the GPU's "
        "memory).",
    )

    @field_validator("concurrency", "k_concurrency")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if any(c < 1 for c in value):
            raise ValueError(f"concurrency levels must be >= 1, got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"concurrency levels must differ (each is measured once), got {value}")
        return value

    @field_validator("temperatures")
    @classmethod
    def _greedy_first(cls, value: list[float]) -> list[float]:
        if 0.0 not in value:
            raise ValueError("must include 0.0: vLLM's greedy τ is what the estimates are compared with")
        if any(t < 0 for t in value):
            raise ValueError(f"temperatures must be >= 0, got {value}")
        return value
