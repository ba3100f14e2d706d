"""The serving contract: what the drafter trained with against what vLLM will apply when it loads the export.

A drafter with good validation loss can still draft garbage in vLLM (τ about
1) when the two disagree, and nothing errors: acceptance just collapses. So
the export, the evaluation and `raypipe check-drafter` compare, for the
exported directory (config.json, the safetensors headers, d2t/t2d) and its
target:

1. rotary: what speculators 0.9's DFlashDraftModel builds from config.json
   (transformers' Qwen3RotaryEmbedding: 1-D, neox-style, over the whole head;
   its default rope ignores `partial_rotary_factor`) against what vLLM's
   DFlash layer builds (`get_rope(head_dim, ...)`: head_dim x
   partial_rotary_factor dims): rotated dims, style, theta, and the cos/sin
   themselves at sampled positions (scaling);
2. no M-RoPE keys in the drafter's rope settings: speculators ignores them,
   vLLM reads them as M-RoPE and its DFlash proposer refuses the drafter;
3. the mask token: set, the one vLLM uses (`dflash_config.mask_token_id`), a
   row of the target's embedding (which vLLM's drafter shares, as training
   copied it), no `mask_embedding.pt` replacing that row, and not a text
   token unless the run chose it (`train.drafter.mask_token_id`);
4. target layers: vLLM's aux layer ids equal the trained ones (speculators'
   `aux_hidden_state_layer_ids`; vLLM's converter stores them as
   `eagle_aux_hidden_state_layer_ids` and `dflash_config.target_layer_ids`
   = id - 1, and reads them back unshifted), inside the target's [0, L],
   ascending (vLLM concatenates them in layer order), the ids served in
   training;
5. attention inside a draft block, per layer: speculators trains full-attention
   layers non-causally whatever the flag; vLLM makes every layer causal when
   `sliding_window_non_causal` is false;
6. hidden size and vocabulary: the drafter's width and vocabulary against the
   target's, fc's shape against vLLM's, draft_vocab_size with d2t/t2d.

Both sides are read in raypipe.train.contract_sides ("what vLLM will apply"
from vLLM's own code where it runs without an engine); the comparison itself
(`compare`) is pure.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.storage import Storage
from raypipe.train.contract_sides import (
    MASK_EMBEDDING_FILE,
    VLLM_DEFAULT_THETA,
    Applied,
    ContractError,
    Drafter,
    TargetFacts,
    library_versions,
    read_drafter,
    trained_view,
    vllm_view,
)

ITEMS = ("rotary", "mrope", "mask_token", "target_layers", "non_causal", "hidden_vocab")
ANGLE_TOLERANCE = 1e-3  # cos/sin; the same rotary in both computes them within float32 rounding (0.0 measured)


@dataclass(frozen=True)
class Check:
    """One compared value: the drafter's (as trained) and vLLM's (as it will apply, or what the target gives it)."""

    item: str  # one of ITEMS
    field: str  # the config key or weight
    trained: Any
    vllm: Any
    problem: str = ""  # one line naming the field, both values and the fix; empty when they agree

    @property
    def ok(self) -> bool:
        return not self.problem


@dataclass(frozen=True)
class Contract:
    """The checks of one drafter against one target, and how they were made."""

    drafter: str
    target: str
    checks: list[Check]
    inputs: dict[str, Any] = field(default_factory=dict)  # configured mask token, served layer ids, target's rope

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[str]:
        return [c.problem for c in self.checks if not c.ok]

    def record(self) -> dict[str, Any]:
        """export.json's `contract`: per item, the values checked on both sides and the verdict."""
        return {
            "verdict": "ok" if self.ok else "mismatch",
            "target": self.target,
            "inputs": self.inputs,
            "items": {item: [asdict(c) for c in self.checks if c.item == item] for item in ITEMS},
            "checked_with": library_versions(),
        }

    def table(self) -> str:
        """The checks as a pass/fail table (raypipe doctor's layout), each failure followed by its message."""
        rows = [(c.item, c.field, _show(c.trained), _show(c.vllm), c) for c in self.checks]
        widths = [max(len(r[k]) for r in [("item", "field", "trained", "vLLM", None), *rows]) + 2 for k in range(4)]
        head = ("item", "field", "trained", "vLLM")
        lines = ["".join(h.ljust(w) for h, w in zip(head, widths)) + "result"]
        for *cells, c in rows:
            lines.append("".join(v.ljust(w) for v, w in zip(cells, widths)) + ("PASS" if c.ok else "FAIL"))
            if not c.ok:
                lines.append(" " * widths[0] + c.problem)
        lines.append(f"{len(self.checks)} checks, {len(self.problems)} failed")
        return "\n".join(lines)

    def require(self) -> None:
        """Raise ContractError naming every mismatch."""
        if not self.ok:
            listed = "\n".join(f"  - {p}" for p in self.problems)
            raise ContractError(
                f"the drafter at {self.drafter} does not match what vLLM will apply with target {self.target} "
                f"({len(self.problems)} mismatches; a drafter served so drafts garbage or is refused):\n{listed}\n"
                f"`raypipe check-drafter {self.drafter} --target {self.target}` prints the whole contract"
            )


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --- the comparison --------------------------------------------------------------------------------------------------


def compare(
    drafter: Drafter,
    trained: Applied,
    vllm: Applied,
    target: TargetFacts,
    configured_mask_token_id: int | None,
    served_layer_ids: list[int] | None,
) -> list[Check]:
    """Every check of the contract, in ITEMS order; pure."""
    return [
        *_rotary(drafter, trained, vllm),
        _mrope(drafter, vllm),
        *_mask_token(trained, vllm, target, configured_mask_token_id),
        *_target_layers(trained, vllm, target, served_layer_ids),
        _non_causal(drafter, trained, vllm),
        *_hidden_vocab(drafter, trained, vllm, target),
    ]


def _check(item: str, field: str, trained: Any, vllm: Any, bad: bool, message: str) -> Check:
    return Check(item, field, trained, vllm, message if bad else "")


def _layer_config(drafter: Drafter) -> dict[str, Any]:
    return drafter.config.get("transformer_layer_config") or {}


def _rotary(drafter: Drafter, t: Applied, v: Applied) -> list[Check]:
    rope = _layer_config(drafter).get("rope_parameters") or _layer_config(drafter).get("rope_scaling") or {}
    where = "transformer_layer_config.rope_parameters"
    setting = (
        f"rope_dim {rope['rope_dim']}"
        if "rope_dim" in rope
        else f"partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)}"
    )
    checks = [
        _check(
            "rotary",
            "rotated dims",
            f"{t.rotated_dims} of {t.head_dim}",
            f"{v.rotated_dims} of {v.head_dim}",
            (t.rotated_dims, t.head_dim) != (v.rotated_dims, v.head_dim),
            f"{where}: the drafter trained rotating {t.rotated_dims} of its {t.head_dim} head dims (speculators' "
            f"{t.rotary} rotates the whole head, ignoring partial_rotary_factor) but vLLM will rotate "
            f"{v.rotated_dims} (head_dim {v.head_dim} x {setting}); set partial_rotary_factor to "
            f"{t.rotated_dims / t.head_dim:g} and drop rope_dim in config.json (what speculators' MRoPE full-head hack "
            "does), then check again",
        ),
        _check(
            "rotary",
            "style",
            _style(t.neox),
            _style(v.neox),
            t.neox != v.neox,
            f"transformer_layer_config.is_neox_style: the drafter trained with {_style(t.neox)} rotation "
            f"(speculators' rotate_half), vLLM will rotate {_style(v.neox)}; remove is_neox_style from config.json",
        ),
        _check(
            "rotary",
            "rope_theta",
            t.rope_theta,
            v.rope_theta,
            t.rope_theta != v.rope_theta,
            f"{where}.rope_theta: the drafter trained with {t.rope_theta:g}, vLLM will apply {v.rope_theta:g} "
            f"(its default when the key is missing is {VLLM_DEFAULT_THETA:g}); set rope_theta to {t.rope_theta:g} in "
            "config.json",
        ),
    ]
    if all(c.ok for c in checks):  # the same rotation, so the same cos/sin layout: compare the values
        checks.append(_angles(t, v, rope))
    return checks


def _style(neox: bool) -> str:
    return "neox (halves)" if neox else "interleaved (gpt-j)"


def _angles(t: Applied, v: Applied, rope: dict[str, Any]) -> Check:
    """The cos/sin both sides compute at the same positions: catches a scaling (yarn, linear, ...) one side applies
    differently."""
    trained = f"{t.rotary} ({t.rope_type})"
    where = f"transformer_layer_config.rope_parameters {rope}"
    if v.angles.shape != t.angles.shape:
        return _check(
            "rotary",
            "cos/sin",
            trained,
            v.rotary,
            True,
            f"{where}: at positions up to max_position_embeddings vLLM's {v.rotary} gives cos/sin of shape "
            f"{list(v.angles.shape)}, training's {t.rope_type} rope {list(t.angles.shape)}; use rope_type default, "
            "linear, dynamic or yarn",
        )
    worst = float(np.abs(t.angles - v.angles).max())
    return _check(
        "rotary",
        "cos/sin",
        trained,
        f"{v.rotary}, max |diff| {worst:.2g}",
        worst > ANGLE_TOLERANCE,
        f"{where}: vLLM's {v.rotary} computes cos/sin up to {worst:.3g} away from training's {t.rotary} "
        f"({t.rope_type}); use a rope_type both implement alike (default)",
    )


def _mrope(drafter: Drafter, v: Applied) -> Check:
    layer = _layer_config(drafter)
    places = {
        "transformer_layer_config": layer,
        "transformer_layer_config.rope_parameters": layer.get("rope_parameters") or {},
        "transformer_layer_config.rope_scaling": layer.get("rope_scaling") or {},
    }
    keys = [f"{where}.{k}" for where, d in places.items() for k in d if k.startswith(("mrope", "xdrope"))]
    return _check(
        "mrope",
        "M-RoPE keys",
        "1-D RoPE" + (f" (ignores {len(keys)} mrope keys)" if keys else ""),
        "M-RoPE: DFlash refuses it" if v.mrope else "1-D RoPE",
        bool(keys) or v.mrope,
        f"{', '.join(keys) or 'M-RoPE'}: the drafter trained with 1-D RoPE (speculators' DFlash ignores them) while "
        "vLLM reads them as M-RoPE (its DFlash proposer refuses a drafter that 'does not support M-RoPE yet', or "
        "rotates by M-RoPE sections); delete them from config.json (text positions are equal in every section)",
    )


def _mask_token(t: Applied, v: Applied, target: TargetFacts, configured: int | None) -> list[Check]:
    mask, vocab, unused = t.mask_token_id, target.shape.vocab_size, len(target.tokens)
    text = target.tokens[mask] if mask is not None and 0 <= mask < unused else None
    explicit = configured is not None and configured == mask
    kind = (
        "unused row"
        if text is None
        else "the tokenizer's mask token"
        if mask == target.mask_token_id
        else f"text token {text!r}" + (" (train.drafter.mask_token_id)" if explicit else "")
    )
    outside = mask is not None and not 0 <= mask < vocab
    row = (
        f"mask_token_id: {mask} is outside the target's embedding ({vocab} rows), which vLLM's drafter shares; "
        f"retrain with train.drafter.mask_token_id unset (the first unused row, {unused}) or an id below {vocab}"
        if outside
        else f"{MASK_EMBEDDING_FILE}: vLLM replaces the target's row {mask} with it, while the drafter trained with "
        "that row itself; delete the file from the drafter directory"
    )
    return [
        _check(
            "mask_token",
            "mask_token_id",
            mask,
            v.mask_token_id,
            mask is None or mask != v.mask_token_id,
            f"mask_token_id: config.json sets none, so vLLM has no token to fill draft slots with; set it to the id "
            f"the drafter trained with (raypipe's default: the first unused row, {unused})"
            if mask is None
            else f"mask_token_id: the drafter trained with {mask}, vLLM will fill draft slots with {v.mask_token_id} "
            "(dflash_config.mask_token_id); set mask_token_id in config.json to the id it trained with",
        ),
        _check(
            "mask_token",
            "mask embedding",
            f"row {mask} of the target's {vocab}",
            MASK_EMBEDDING_FILE if v.mask_embedding_file else f"row {v.mask_token_id} of the target's {vocab}",
            outside or v.mask_embedding_file,
            row,
        ),
        _check(
            "mask_token",
            "mask token kind",
            kind,
            kind,
            text is not None and mask != target.mask_token_id and not explicit,
            f"mask_token_id: {mask} is the text token {text!r} and train.drafter.mask_token_id did not choose it: the "
            "drafter cannot tell a masked slot from that token; retrain with train.drafter.mask_token_id unset "
            "(the first "
            f"unused row, {unused}), or set train.drafter.mask_token_id={mask} if it was meant",
        ),
    ]


def _target_layers(t: Applied, v: Applied, target: TargetFacts, served: list[int] | None) -> list[Check]:
    layers, ids = target.shape.num_layers, t.aux_layer_ids
    key = "aux_hidden_state_layer_ids"
    bad = [i for i in ids if not 0 <= i <= layers]
    why = (
        f"{bad} do not exist in the target's {layers} layers (vLLM captures ids 0..{layers}: id i enters decoder layer "
        "i), so it would feed fewer features and fail at the first draft"
        if bad
        else "are empty"
        if not ids
        else "are not distinct and ascending, while vLLM concatenates the captured layers in layer order"
    )
    checks = [
        _check(
            "target_layers",
            key,
            ids,
            v.aux_layer_ids,
            ids != v.aux_layer_ids,
            f"{key}: the drafter trained on the target's layers {ids}, vLLM will capture {v.aux_layer_ids} "
            f"(eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1); name the trained ids in "
            f"{key} only",
        ),
        _check(
            "target_layers",
            f"{key} in the target",
            ids,
            f"ids 0..{layers} (of {layers} layers)",
            bool(bad) or not ids or ids != sorted(set(ids)),
            f"{key} {ids}: {why}; train with serve.layer_ids distinct, ascending and within [0, {layers}] for this "
            "target (is it the target the drafter was trained for?)",
        ),
    ]
    if served is not None:
        trained_on = list(served[:-1])  # the last served id feeds the loss targets, not the drafter
        checks.append(
            _check(
                "target_layers",
                "served in training",
                ids,
                trained_on,
                ids != trained_on,
                f"{key}: config.json names {ids} but training read the target's layers {trained_on} "
                f"(serve.layer_ids {list(served)} but the last); set {key} to {trained_on}",
            )
        )
    return checks


def _non_causal(drafter: Drafter, t: Applied, v: Applied) -> Check:
    flag = json.dumps(drafter.config.get("sliding_window_non_causal"))
    return _check(
        "non_causal",
        "attention in a draft block",
        t.attention,
        v.attention,
        t.attention != v.attention,
        f"sliding_window_non_causal={flag}: per draft layer the drafter trained {t.attention} (speculators attends "
        f"non-causally in full-attention layers whatever the flag), vLLM will attend {v.attention} (false makes "
        "dflash_config.causal true for every layer); set sliding_window_non_causal to true in config.json",
    )


def _hidden_vocab(drafter: Drafter, t: Applied, v: Applied, target: TargetFacts) -> list[Check]:
    hidden, vocab = target.shape.hidden_size, target.shape.vocab_size
    fc = list(drafter.tensors["fc.weight"]) if "fc.weight" in drafter.tensors else None
    expected = [v.hidden_size, v.fc_in_features]
    target_hidden = drafter.config.get("target_hidden_size")
    draft_vocab = _draft_vocab_problem(drafter, t.draft_vocab_size, v.draft_vocab_size, vocab)
    return [
        _check(
            "hidden_vocab",
            "hidden_size",
            t.hidden_size,
            hidden,
            t.hidden_size != hidden or v.hidden_size != hidden,
            f"transformer_layer_config.hidden_size: the drafter is {t.hidden_size} wide, the target {hidden}: vLLM "
            "shares the target's embedding only at equal widths and feeds the target's states to fc; check the "
            "drafter against the target it was trained for, or retrain for this one",
        ),
        _check(
            "hidden_vocab",
            "target_hidden_size",
            target_hidden,
            hidden,
            target_hidden not in (None, hidden),
            f"target_hidden_size: config.json says {target_hidden}, the target's hidden states are {hidden} wide; "
            "set it to null",
        ),
        _check(
            "hidden_vocab",
            "fc.weight",
            fc,
            expected,
            fc != expected,
            f"fc.weight: the weights hold {fc}, vLLM builds fc as {expected} ({len(v.aux_layer_ids)} target layer(s) "
            "of the drafter's width); the config does not describe these weights: export the checkpoint's own "
            "config.json",
        ),
        _check(
            "hidden_vocab",
            "vocab_size",
            t.vocab_size,
            vocab,
            t.vocab_size != vocab or v.vocab_size != vocab,
            f"transformer_layer_config.vocab_size: the drafter's is {t.vocab_size}, the target's {vocab}: vLLM's "
            f"drafter scores {v.vocab_size} ids for the target's sampler; check it against its own target or retrain",
        ),
        _check(
            "hidden_vocab",
            "draft vocabulary",
            f"{t.draft_vocab_size} of {vocab}",
            f"{v.draft_vocab_size} of {vocab}",
            draft_vocab is not None,
            draft_vocab or "",
        ),
    ]


def _draft_vocab_problem(drafter: Drafter, size: int, served: int, vocab: int) -> str | None:
    """draft_vocab_size, d2t, t2d and lm_head as vLLM maps draft ids to target ids (target id = i + d2t[i])."""
    d2t, t2d = drafter.vocab.get("d2t"), drafter.vocab.get("t2d")
    head = drafter.tensors.get("lm_head.weight")
    again = "export the checkpoint's own weights"
    if served != size or not 0 < size <= vocab:
        return f"draft_vocab_size: {size} must be in [1, {vocab}] and what vLLM reads ({served})"
    if size == vocab:
        if d2t is None and t2d is None:
            return None
        return (
            "d2t/t2d: a full-vocabulary drafter ships a mapping vLLM has no place for (it loads d2t only when "
            f"draft_vocab_size < {vocab}); drop them from the weights"
        )
    if d2t is None or d2t.shape != (size,):
        held = "no d2t" if d2t is None else f"d2t of shape {list(d2t.shape)}"
        return (
            f"d2t: vLLM maps draft id i to target id i + d2t[i], but the weights hold {held} for {size} draft ids "
            f"(without it vLLM keeps zeros: draft id i read as target id i); {again}"
        )
    ids = np.arange(size) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab or np.any(np.diff(ids) <= 0):
        return f"d2t: draft ids map to target ids outside [0, {vocab}) or not ascending; {again}"
    if t2d is None or t2d.shape != (vocab,) or int(t2d.sum()) != size or not t2d[ids].all():
        return f"t2d: does not mark exactly the target ids d2t maps to; {again}"
    if head is None or head[0] != size:
        held = list(head) if head else "none"
        return (
            f"lm_head.weight: a draft vocabulary needs the drafter's own {size}-row head, the weights hold {held}; "
            + again
        )
    return None


# --- the whole check -------------------------------------------------------------------------------------------------


def check_drafter(
    directory: Storage,
    target: TargetFacts,
    *,
    configured_mask_token_id: int | None,
    served_layer_ids: list[int] | None,
) -> Contract:
    """The contract of the drafter in `directory` (local or fsspec) with `target` (TargetFacts.load).
    `configured_mask_token_id`: the run's train.drafter.mask_token_id (an explicit choice); `served_layer_ids`: the
    serve.layer_ids training read (None: unknown, not checked)."""
    drafter = read_drafter(directory)
    with tempfile.TemporaryDirectory() as local:  # both libraries read a local config.json
        Path(local, "config.json").write_text(json.dumps(drafter.config))
        trained, vllm = trained_view(local), vllm_view(local, drafter)
    checks = compare(drafter, trained, vllm, target, configured_mask_token_id, served_layer_ids)
    inputs = {
        "configured_mask_token_id": configured_mask_token_id,
        "served_layer_ids": served_layer_ids,
        "target_rope_parameters": target.rope_parameters,
        "target_num_layers": target.shape.num_layers,
        "target_hidden_size": target.shape.hidden_size,
        "target_vocab_size": target.shape.vocab_size,
        "tokenizer_size": len(target.tokens),
    }
    return Contract(directory.url, target.path, checks, inputs)
