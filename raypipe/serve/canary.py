"""The parity canary: the serving engine's states against the transformers reference, per layer.

A wrong layer id or a missing final norm does not crash anything; the
drafter just learns from the wrong stream and acceptance collapses. The
canary makes that a loud, named failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
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
        return (
            f"canary failed (tolerance {self.tolerance}): "
            + "; ".join(bad)
            + ": check the layer mapping and the final norm"
        )


def compare_states(
    got: list[torch.Tensor], ref: list[torch.Tensor], layer_ids: tuple[int, ...], tolerance: float = BF16_TOLERANCE
) -> CanaryReport:
    """Per-layer error of `got` against `ref`, both lists of [T, n_layers, H]."""
    assert len(got) == len(ref) and all(g.shape == r.shape for g, r in zip(got, ref)), "canary shapes differ"
    errors = []
    for j in range(len(layer_ids)):
        err = max(
            float((g[:, j].float() - r[:, j].float()).abs().max() / r[:, j].float().abs().max().clamp_min(1e-12))
            for g, r in zip(got, ref)
        )
        errors.append(err)
    return CanaryReport(tuple(layer_ids), tuple(errors), tolerance)


class Canary:
    """The canary of one replica: its transformers reference is computed once, on first use, in bf16, and runs are
    serialized.

    The reference is a full copy of the target (fp32 would be twice the
    serving weights, on every call); only its states on the canary prompts are
    kept, a few MB, and the model is freed once they are computed. bf16 against
    an fp32 or bf16 engine stays within `BF16_TOLERANCE` (about 1e-2 on the
    tiny targets), while a wrong layer is off by tens of percent.
    """

    def __init__(self, model_dir: str, layer_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.layer_ids = tuple(layer_ids)
        self.builds = 0  # how often the reference was computed: once per replica
        self.runs = 0
        self.reference_dtype: str | None = None
        self._reference: tuple[list[list[int]], list[torch.Tensor]] | None = None
        self._lock = (
            asyncio.Lock()
        )  # one run at a time: two at once would load two references and double the engine's load

    def _build(self) -> tuple[list[list[int]], list[torch.Tensor]]:
        from raypipe.serve.hf_engine import TransformersEngine

        engine = TransformersEngine(self.model_dir, self.layer_ids, dtype="bfloat16")
        prompts = canary_prompts(engine.vocab_size)
        self.reference_dtype = str(engine.model.dtype).removeprefix("torch.")
        self.builds += 1
        return prompts, engine.extract(prompts)

    async def run(self, served: Callable[[list[list[int]]], Awaitable[list[torch.Tensor]]]) -> CanaryReport:
        """Compare the states `served` returns for the canary prompts with the reference, per layer."""
        async with self._lock:
            if self._reference is None:
                self._reference = await asyncio.to_thread(
                    self._build
                )  # the replica keeps answering health checks meanwhile
            prompts, reference = self._reference
            got = await served(prompts)
            self.runs += 1
            return compare_states(got, reference, self.layer_ids)
