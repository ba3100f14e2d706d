"""Speculative decoding with an exported drafter in vLLM, and vLLM's own acceptance counters.

The counters are vLLM's spec-decode metrics, read before and after generation:
drafts (verification steps that carried a draft), draft tokens, accepted
tokens, and accepted tokens per draft position. Acceptance length
τ = 1 + accepted / drafts (the bonus token plus the accepted drafts per step).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeCounts:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    generated_tokens: int
    seconds: float

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tau": self.tau}


def _read(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {name: 0 for name in COUNTERS.values()}
    per_position: list[int] = []
    for metric in llm.get_metrics():  # one entry per label set: sum them
        if metric.name in COUNTERS and isinstance(metric, Counter):
            out[COUNTERS[metric.name]] += metric.value
        elif metric.name == PER_POSITION and isinstance(metric, Vector):
            per_position = [a + b for a, b in zip(per_position or [0] * len(metric.values), metric.values)]
    out["accepted_per_position"] = per_position
    return out


def run_speculative(
    target: str, drafter: str, num_speculative_tokens: int, prompts: list[list[int]], *,
    max_tokens: int = 64, temperature: float = 0.0, dtype: str = "auto", max_model_len: int = 2048,
    gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
) -> tuple[list[list[int]], SpecDecodeCounts]:
    """Generate with the drafter in vLLM; returns the replies and vLLM's counters for this generation."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": num_speculative_tokens},
        dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager, disable_log_stats=False, seed=0,
    )
    before = _read(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _read(llm)
    replies = [list(o.outputs[0].token_ids) for o in outputs]
    per_position = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"] or [0] * num_speculative_tokens)]
    counts = SpecDecodeCounts(
        drafts=after["drafts"] - before["drafts"],
        draft_tokens=after["draft_tokens"] - before["draft_tokens"],
        accepted_tokens=after["accepted_tokens"] - before["accepted_tokens"],
        accepted_per_position=per_position,
        generated_tokens=sum(map(len, replies)),
        seconds=seconds,
    )
    return replies, counts
