"""Generation in vLLM, with or without a DFlash drafter, and vLLM's own acceptance counters.

The counters are vLLM's spec-decode metrics, read before and after each
generation: drafts (verification steps that carried a draft), draft tokens,
accepted tokens, and accepted tokens per draft position. Acceptance length
τ = 1 + accepted / drafts (the bonus token plus the accepted drafts per step).
One engine serves every temperature; a short warm-up generation runs first so
that tokens/s compares like with like across engines.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Generation:
    """One generation over the prompt set at one temperature, and vLLM's counters for it."""

    temperature: float
    replies: list[list[int]]
    seconds: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    categories: dict[str, dict[str, Any]] = field(default_factory=dict)  # per category: its generation's summary

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.replies))

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def summary(self) -> dict[str, Any]:
        """Everything but the replies, plus τ, per-position acceptance rates and tokens/s."""
        doc = {k: v for k, v in asdict(self).items() if k != "replies"}
        rates = [a / self.drafts for a in self.accepted_per_position] if self.drafts else []
        return {
            **doc,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.tokens_per_s,
            "tau": self.tau,
            "acceptance_per_position": rates,
        }


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


def generate_once(llm: Any, prompts: list[list[int]], temperature: float, max_tokens: int, label: str) -> Generation:
    """One generate call over `prompts`, with the counters it moved."""
    from vllm import SamplingParams

    from raypipe.progress import vllm_progress

    before = _read(llm)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0),
        use_tqdm=vllm_progress(f"[eval] {label}, temperature {temperature:g}"),
    )
    seconds = time.perf_counter() - start
    after = _read(llm)
    width = len(after["accepted_per_position"])
    return Generation(
        temperature=temperature,
        replies=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        drafts=after["drafts"] - before["drafts"],
        draft_tokens=after["draft_tokens"] - before["draft_tokens"],
        accepted_tokens=after["accepted_tokens"] - before["accepted_tokens"],
        accepted_per_position=[
            a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"] or [0] * width)
        ],
    )


def merge(temperature: float, parts: dict[str, Generation], groups: dict[str, list[int]]) -> Generation:
    """The per-category generations as one over all prompts (replies back in prompt order), each kept summarised."""
    replies: list[list[int]] = [[] for _ in range(sum(map(len, groups.values())))]
    for name, positions in groups.items():
        for position, reply in zip(positions, parts[name].replies, strict=True):
            replies[position] = reply
    widths = {len(p.accepted_per_position) for p in parts.values()} - {0}
    per_position = [
        sum(p.accepted_per_position[k] for p in parts.values() if p.accepted_per_position)
        for k in range(max(widths, default=0))
    ]
    return Generation(
        temperature=temperature,
        replies=replies,
        seconds=sum(p.seconds for p in parts.values()),
        drafts=sum(p.drafts for p in parts.values()),
        draft_tokens=sum(p.draft_tokens for p in parts.values()),
        accepted_tokens=sum(p.accepted_tokens for p in parts.values()),
        accepted_per_position=per_position,
        categories={name: p.summary() for name, p in parts.items()},
    )


def generate_in_vllm(
    engine: dict[str, Any],
    drafter: str | None,
    num_speculative_tokens: int,
    prompts: list[list[int]],
    temperatures: list[float],
    *,
    max_tokens: int,
    label: str = "vLLM",
    groups: dict[str, list[int]] | None = None,
) -> list[Generation]:
    """Generate the prompt set once per temperature on one engine (`vllm.LLM` arguments, raypipe.serve.vllm_args),
    speculative when `drafter` is given; `label` names its progress lines. With `groups` (prompt positions per
    category) each category is its own generate call, so that its τ and tokens/s are its own."""
    from vllm import LLM, SamplingParams

    from raypipe.serve.reaper import engine_processes

    speculative = (
        {"method": "dflash", "model": drafter, "num_speculative_tokens": num_speculative_tokens} if drafter else None
    )
    with engine_processes() as processes:  # the engine core's and workers' processes, ended by pid when this ends
        llm = LLM(**engine, speculative_config=speculative)
    try:
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=8), use_tqdm=False
        )  # warm-up
        runs = []
        for temperature in temperatures:
            if groups is None:
                runs.append(generate_once(llm, prompts, temperature, max_tokens, label))
                continue
            parts = {
                name: generate_once(llm, [prompts[i] for i in positions], temperature, max_tokens, f"{label}, {name}")
                for name, positions in groups.items()
            }
            runs.append(merge(temperature, parts, groups))
        return runs
    finally:
        processes.reap()
