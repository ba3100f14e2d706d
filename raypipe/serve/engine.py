"""The narrow interface every hidden-state engine implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    """How on-policy replies are sampled; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None


class HiddenStateEngine(Protocol):
    layer_ids: tuple[int, ...]  # raypipe.serve.layers convention
    hidden_size: int

    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states per sequence, each [T, len(layer_ids), hidden_size] in float32."""
        ...

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Reply token ids per prompt, through the end-of-turn token when the model emits it."""
        ...
