"""What engines share: how on-policy replies are sampled."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """How on-policy replies are sampled; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # the end-of-turn token, where the model's eos is another one
