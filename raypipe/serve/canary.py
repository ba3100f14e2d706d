"""The parity canary: the serving engine's states against the transformers reference, per layer.

A wrong layer id or a missing final norm does not crash anything; the
drafter just learns from the wrong stream and acceptance collapses. The
canary makes that a loud, named failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# bf16 keeps 8 bits of mantissa: about 4e-3 relative per value, accumulated over a few layers.
BF16_TOLERANCE = 3e-2
CANARY_PROMPTS: tuple[tuple[int, ...], ...] = (
    (9707, 1879),
    (151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198),
    tuple(range(1000, 1064)),
)


def canary_prompts(vocab_size: int) -> list[list[int]]:
    """The canary prompts folded into the target's vocabulary (small vocabularies such as the demo target's)."""
    return [[t % vocab_size for t in p] for p in CANARY_PROMPTS]


@dataclass(frozen=True)
class CanaryReport:
    layer_ids: tuple[int, ...]
    errors: tuple[float, ...]  # per layer: max |got - ref| / max |ref| over the canary prompts
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(e <= self.tolerance for e in self.errors)

    def message(self) -> str:
        bad = [f"layer {i}: relative error {e:.3g}" for i, e in zip(self.layer_ids, self.errors) if e > self.tolerance]
        if not bad:
            return f"canary ok: max relative error {max(self.errors):.3g} <= {self.tolerance}"
        return f"canary failed (tolerance {self.tolerance}): " + "; ".join(bad) + ": check the layer mapping and the final norm"


def compare_states(got: list[torch.Tensor], ref: list[torch.Tensor], layer_ids: tuple[int, ...], tolerance: float = BF16_TOLERANCE) -> CanaryReport:
    """Per-layer error of `got` against `ref`, both lists of [T, n_layers, H]."""
    assert len(got) == len(ref) and all(g.shape == r.shape for g, r in zip(got, ref)), "canary shapes differ"
    errors = []
    for j in range(len(layer_ids)):
        err = max(float((g[:, j].float() - r[:, j].float()).abs().max() / r[:, j].float().abs().max().clamp_min(1e-12)) for g, r in zip(got, ref))
        errors.append(err)
    return CanaryReport(tuple(layer_ids), tuple(errors), tolerance)
