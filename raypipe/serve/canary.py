"""The parity canary: the serving engine's states against the transformers reference, per layer and per token.

A wrong layer id, a missing final norm or states the engine never wrote
(older vLLM returned all-zero states for hybrid targets' layers) do not crash
anything; the drafter just learns from the wrong stream and acceptance
collapses. The canary makes each a loud failure that names the layer, its kind
on a hybrid target, and what is wrong with it.

Each token's error is relative to its own vector (L2), so the huge vectors
some models keep at the first token do not hide the others; zero and
non-finite tokens are named by position, each prompt is judged on its own
(root mean square over its tokens), and so is each token, more loosely: a
layer zero only past a block boundary, or wrong only on one prompt's tail, is
not averaged away by the tokens that are right.

The reference runs on the replica's one CPU at any target size: streamed one
decoder layer at a time from the safetensors files
(raypipe.serve.streamed_reference), it holds one layer and the batch's
activations instead of the whole model (at Qwen3.6-27B 2.2 GiB with the process
instead of 54 GB: reference_bytes below) and takes about 2 minutes of one CPU
thread there with the weights in the page cache (bench/canary_scale.py measures
2.4 s per GB of decoder weights; a cold start adds reading them from disk). Its
states equal the whole model's, bit for bit. Each replica computes its own: a
verdict cached per model fingerprint would let a later replica skip checking its
own engine (another vLLM build, GPU, tensor parallelism or dtype), which is what
the canary is for; caching the reference states instead would need storage that
every replica sees, which a service started on its own does not have. Running
it on the replica's GPU would contend for the memory vLLM sized itself to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from raypipe.target import TargetShape

# bf16 keeps 8 bits of mantissa: about 4e-3 relative per value, accumulated over a few layers.
BF16_TOLERANCE = 3e-2
# A prompt's worst token is a few times its root mean square error (bf16 against fp32 on the demo target: 0.0455 at
# 0.0142): a single token may be off by TOKEN_FACTOR x the tolerance, so the token check never fails what passes as
# noise per prompt, while a token from the wrong place or layer (off by 0.2 to 1 and more) still fails on its own.
TOKEN_FACTOR = 5
# A reference token whose norm is under FLOOR x the layer's median token norm is judged against that floor, not its
# own norm: noise on a near-zero reference token is not divided by ~0.
FLOOR = 1e-2
# One token (a Gated DeltaNet state after a single step), two, a chat prompt, and 160 tokens: across Gated DeltaNet's
# 64-token chunks and past the 128-token blocks of vLLM's hidden-state cache on CPU (the blocks older vLLM mis-sized
# on hybrid targets). Every serve.max_model_len must exceed the longest.
CANARY_PROMPTS: tuple[tuple[int, ...], ...] = (
    (9707,),
    (9707, 1879),
    (151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198),
    tuple(range(1000, 1160)),
)
SHAPE_FIX = "check serve.layer_ids and the engine's hidden size"
REFERENCE_FIX = "the transformers reference itself is unusable there: check the target's weights"
NON_FINITE_FIX = "the engine overflowed or read unwritten memory: check serve.dtype"
ZERO_FIX = "the engine left those states unwritten (older vLLM did on hybrid layers; raypipe pins vllm 0.32)"
ERROR_FIX = "check the layer mapping (raypipe.target) and the final norm"


def canary_prompts(vocab_size: int, max_len: int | None = None) -> list[list[int]]:
    """The canary prompts folded into the target's vocabulary (small vocabularies such as the demo target's) and cut
    to the `max_len` tokens the engine takes (raypipe.serve.validate), so a short `serve.max_model_len` never turns
    the canary into an engine error."""
    return [[t % vocab_size for t in p][:max_len] for p in CANARY_PROMPTS]


def layer_kinds(shape: TargetShape, layer_ids: tuple[int, ...]) -> tuple[str, ...] | None:
    """What each served id is on a hybrid target, where a failure that follows the layer kind is the tell; None on a
    target of one kind. Id i is decoder layer i-1's output (raypipe.target)."""
    if not shape.hybrid:
        return None
    return tuple("embeddings" if i == 0 else f"{shape.layer_types[i - 1]} output" for i in layer_ids)


@dataclass(frozen=True)
class Problem:
    what: str  # e.g. "zero at prompt 3 (160 tokens) positions 128-159"
    fix: str


@dataclass(frozen=True)
class LayerCheck:
    layer_id: int
    kind: str | None  # layer_kinds: "linear_attention output", ... on a hybrid target
    error: float  # the worst prompt's relative error (root mean square over its tokens); NaN: nothing compared
    token_error: float  # the worst single token's relative error
    problems: tuple[Problem, ...]

    @property
    def name(self) -> str:
        return f"layer {self.layer_id}" + (f" ({self.kind})" if self.kind else "")


@dataclass(frozen=True)
class CanaryReport:
    layers: tuple[LayerCheck, ...]
    tolerance: float
    mismatch: str | None = None  # the served states' shapes differ from the reference's: no layer was compared

    @property
    def errors(self) -> tuple[float, ...]:
        return tuple(c.error for c in self.layers)

    @property
    def ok(self) -> bool:
        return self.mismatch is None and not any(c.problems for c in self.layers)

    def message(self) -> str:
        """One line for /canary, /stats, a refused replica and the train stage: each failing layer, what is wrong
        with it, and the fixes."""
        if self.mismatch is not None:
            return f"canary failed: {self.mismatch}. Fix: {SHAPE_FIX}"
        if self.ok:
            ids = ", ".join(str(c.layer_id) for c in self.layers)
            worst_token = max(c.token_error for c in self.layers)
            return (
                f"canary ok: relative error {max(self.errors):.3g} <= {self.tolerance} per prompt, {worst_token:.3g} "
                f"<= {TOKEN_FACTOR * self.tolerance:.3g} per token (layers {ids})"
            )
        failed = [c for c in self.layers if c.problems]
        fixes = dict.fromkeys(p.fix for c in failed for p in c.problems)
        return (
            "canary failed: "
            + "; ".join(f"{c.name}: " + ", ".join(p.what for p in c.problems) for c in failed)
            + ". Fix: "
            + "; ".join(fixes)
        )


def _ranges(positions: list[int], most: int = 3) -> str:
    """Ascending positions as their first `most` runs: '0-14,128-159'."""
    runs: list[list[int]] = []
    for i in positions:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most])
    return text + (f" and {len(runs) - most} more runs" if len(runs) > most else "")


def _prompt(p: int, lengths: list[int]) -> str:
    return f"prompt {p} ({lengths[p]} token{'s' * (lengths[p] != 1)})"


def _where(rows: torch.Tensor, lengths: list[int]) -> str:
    """The prompts and positions of the set rows of a mask over all prompts' tokens, concatenated: a zero tail past
    position 128 reads differently from a zero first token."""
    parts = []
    for p, mask in enumerate(rows.split(lengths)):
        at = mask.nonzero().flatten().tolist()
        if at:
            parts.append(f"{_prompt(p, lengths)} position{'s' * (len(at) != 1)} {_ranges(at)}")
    return ", ".join(parts)


def _reference_problem(ref: torch.Tensor, lengths: list[int]) -> Problem | None:
    """A reference with nothing to compare against: non-finite tokens, or a layer mostly of zero tokens."""
    bad = ~ref.isfinite().all(-1)
    if bad.any():
        return Problem(f"the reference is non-finite at {_where(bad, lengths)}", REFERENCE_FIX)
    if ref.norm(dim=-1).median() == 0:
        return Problem(f"the reference is zero at {_where(ref.abs().amax(-1) == 0, lengths)}", REFERENCE_FIX)
    return None


def _rms(errors: torch.Tensor) -> float:
    return float(errors.pow(2).mean().sqrt()) if errors.numel() else 0.0


def _check_layer(
    layer_id: int, kind: str | None, got: torch.Tensor, ref: torch.Tensor, lengths: list[int], tolerance: float
) -> LayerCheck:
    """One layer's served tokens [N, H] (every prompt's, concatenated) against the reference's, each token judged
    on its own scale: non-finite tokens, zero tokens where the reference has none, prompts off by more than
    `tolerance` (root mean square over their tokens), and tokens off by more than TOKEN_FACTOR x `tolerance`."""
    unusable = _reference_problem(ref, lengths)
    if unusable is not None:
        return LayerCheck(layer_id, kind, float("nan"), float("nan"), (unusable,))
    ref_norm = ref.norm(dim=-1)
    errors = (got - ref).norm(dim=-1) / ref_norm.clamp_min(FLOOR * float(ref_norm.median()))
    non_finite = ~got.isfinite().all(-1)
    zero = (got.abs().amax(-1) == 0) & (ref_norm > 0)
    compared = ~non_finite & ~zero
    per_prompt = [_rms(e[c]) for e, c in zip(errors.split(lengths), compared.split(lengths))]
    off_prompts = [p for p, e in enumerate(per_prompt) if e > tolerance]
    off_tokens = compared & (errors > TOKEN_FACTOR * tolerance)
    # Named by position only in prompts that are partly off (a wrong tail); a prompt off at every token is named whole.
    partly = torch.cat([o & ~o[c].all() for o, c in zip(off_tokens.split(lengths), compared.split(lengths))])
    problems = []
    if non_finite.any():
        problems.append(Problem(f"non-finite at {_where(non_finite, lengths)}", NON_FINITE_FIX))
    if (got == 0).all():
        problems.append(Problem("all zeros", ZERO_FIX))
    elif zero.any():
        problems.append(Problem(f"zero at {_where(zero, lengths)}", ZERO_FIX))
    if off_prompts:
        on = "every prompt" if len(off_prompts) == len(lengths) else ", ".join(_prompt(p, lengths) for p in off_prompts)
        problems.append(Problem(f"relative error {max(per_prompt):.3g} > {tolerance} on {on}", ERROR_FIX))
    if partly.any():
        worst, where = float(errors[partly].max()), _where(partly, lengths)
        problems.append(Problem(f"tokens off by {worst:.3g} > {TOKEN_FACTOR * tolerance:.3g} at {where}", ERROR_FIX))
    token_error = float(errors[compared].max()) if compared.any() else float("nan")
    return LayerCheck(layer_id, kind, max(per_prompt), token_error, tuple(problems))


def _shape_mismatch(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str | None:
    """Why the served states cannot be compared with the reference's at all, if they cannot."""
    if len(got) != len(ref):
        return f"{len(got)} sequences served for {len(ref)} canary prompts"
    for p, (g, r) in enumerate(zip(got, ref)):
        if g.shape != r.shape:
            return (
                f"prompt {p}: served states of shape {list(g.shape)} [T, n_layers, H], the reference's {list(r.shape)}"
            )
    return None


def compare_states(
    got: list[torch.Tensor],
    ref: list[torch.Tensor],
    layer_ids: tuple[int, ...],
    kinds: tuple[str, ...] | None = None,
    tolerance: float = BF16_TOLERANCE,
) -> CanaryReport:
    """Each served layer of `got` against `ref` (one [T, n_layers, H] per prompt), token by token; `kinds` names what
    each layer is on a hybrid target (layer_kinds)."""
    assert all(r.shape[1] == len(layer_ids) for r in ref), "the reference serves other layers"
    mismatch = _shape_mismatch(got, ref)
    if mismatch is not None:
        return CanaryReport((), tolerance, mismatch)
    lengths = [len(r) for r in ref]
    checks = (
        _check_layer(
            layer_id,
            kinds[j] if kinds else None,
            torch.cat([g[:, j] for g in got]).float(),
            torch.cat([r[:, j] for r in ref]).float(),
            lengths,
            tolerance,
        )
        for j, layer_id in enumerate(layer_ids)
    )
    return CanaryReport(tuple(checks), tolerance)


@dataclass(frozen=True)
class Reference:
    """What a replica keeps of its reference: the prompts folded into the target's vocabulary, their states."""

    prompts: list[list[int]]
    states: list[torch.Tensor]
    kinds: tuple[str, ...] | None


class Canary:
    """The canary of one replica: its transformers reference is computed once, on first use, in bf16, and runs are
    serialized.

    The reference streams the target one decoder layer at a time (fp32 would
    double each layer); only its states on the canary prompts are kept, 22 MB
    at 27B. bf16 against an fp32 or bf16 engine stays within `BF16_TOLERANCE`
    per prompt (under 1e-2 on the tiny targets, 0.0142 on the trained demo
    target), while a wrong layer is off by tens of percent.
    """

    def __init__(self, model_dir: str, layer_ids: tuple[int, ...], max_len: int | None = None) -> None:
        self.model_dir = model_dir
        self.layer_ids = tuple(layer_ids)
        self.max_len = max_len  # the longest sequence the engine takes
        self.builds = 0  # how often the reference was computed: once per replica
        self.runs = 0
        self.reference_dtype: str | None = None
        self._reference: Reference | None = None
        self._lock = (
            asyncio.Lock()
        )  # one run at a time: two at once would compute two references and double the engine's load

    def _build(self) -> Reference:
        from raypipe.serve.streamed_reference import StreamedReference

        reference = StreamedReference(self.model_dir, self.layer_ids, dtype=torch.bfloat16)
        prompts = canary_prompts(reference.vocab_size, self.max_len)
        self.reference_dtype = str(reference.dtype).removeprefix("torch.")
        self.builds += 1
        kinds = layer_kinds(TargetShape.of(reference.model.config), self.layer_ids)
        return Reference(prompts, reference.extract(prompts), kinds)

    async def run(self, served: Callable[[list[list[int]]], Awaitable[list[torch.Tensor]]]) -> CanaryReport:
        """Compare the states `served` returns for the canary prompts with the reference, per layer and token."""
        async with self._lock:
            if self._reference is None:
                self._reference = await asyncio.to_thread(
                    self._build
                )  # the replica keeps answering health checks meanwhile
            reference = self._reference
            got = await served(reference.prompts)
            self.runs += 1
            return compare_states(got, reference.states, self.layer_ids, reference.kinds)


def decoder_layer_bytes(config: Any) -> list[int]:
    """Each decoder layer's weights in bf16, counted on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM

    from raypipe.serve.hf_engine import decoder_parts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [sum(p.numel() for p in layer.parameters()) * 2 for layer in decoder_parts(model)[2]]


def reference_bytes(config: Any) -> int:
    """Peak host memory of the streamed reference (raypipe.serve.streamed_reference) over the process's own
    (Python, torch and transformers imported: 0.4 GiB): the largest decoder layer in bf16, resident alone, plus the
    activations of the canary batch (its prompts right-padded to the longest). Those are dominated on hybrid targets
    by transformers' fp32 Gated DeltaNet and by the MLP, and the heap keeps what fragments among them (under
    raypipe.heap.HEAP_ENV nothing is given back): 64 x 4 bytes per padded token per unit of the larger of the hidden
    size and Gated DeltaNet's value width, plus 4 x 4 bytes per unit of intermediate size, fitted with margin to
    bench/canary_scale.py's target with the reference computed 4 times over in one process (the heap of a target 4x
    as deep: up to 0.75 GiB over the imports, against 0.60 GiB computed once).

    Qwen3.6-27B: 1.82 GiB (a Gated DeltaNet layer of 0.77 GB, 1.10 GiB of activations), 2.2 GiB with the process,
    where the whole model held its 54 GB of weights."""
    text = config.get_text_config()
    padded = len(CANARY_PROMPTS) * max(map(len, CANARY_PROMPTS))
    linear_width = getattr(text, "linear_num_value_heads", 0) * getattr(text, "linear_value_head_dim", 0)
    activations = padded * 4 * (64 * max(text.hidden_size, linear_width) + 4 * text.intermediate_size)
    return max(decoder_layer_bytes(config)) + activations
