"""Which residual stream a layer id means: one convention for every engine.

raypipe uses vLLM's `extract_hidden_states` convention. For a target with L
decoder layers, a layer id i is in [0, L] and names the residual stream
*entering* decoder layer i:

- id 0 is the token embeddings;
- id i (1 <= i < L) is the output of decoder layer i-1, which is
  transformers' `output_hidden_states[i]`;
- id L is the output of the last decoder layer *before* the final norm.
  transformers' last `hidden_states` entry is *after* the final norm, so it is
  not id L; the reference engine hooks the norm's input instead.

The DFlash drafter consumes the auxiliary layers (speculators'
`aux_hidden_state_layer_ids`, five spread from layer 1 to L-3 by default)
concatenated, plus id L as `verifier_last_hidden_states`, to which it applies
the target's own final norm and LM head. A wrong id does not crash anything;
acceptance just collapses, so the service's canary compares engines on it.
"""

from __future__ import annotations


def check_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> None:
    """Ids must be distinct, ascending and within [0, num_layers]."""
    if not layer_ids:
        raise ValueError("serve.layer_ids: give at least one layer id")
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"serve.layer_ids must be distinct and ascending, got {list(layer_ids)}")
    if layer_ids[0] < 0 or layer_ids[-1] > num_layers:
        raise ValueError(
            f"serve.layer_ids must lie in [0, {num_layers}] for a target with {num_layers} layers, got "
            f"{list(layer_ids)}"
        )


def default_layer_ids(num_layers: int, num_aux: int = 5) -> tuple[int, ...]:
    """DFlash's default: `num_aux` layers spread evenly from 1 to L-3, then L (the last, pre-norm)."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for DFlash's default layers, got {num_layers}")
    first, last = 1, num_layers - 3
    count = min(num_aux, last - first + 1)
    aux = sorted({round(first + k * (last - first) / max(count - 1, 1)) for k in range(count)})
    return (*aux, num_layers)


def resolve_layer_ids(layer_ids: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """The configured ids (checked), else DFlash's default: what the service serves and the drafter reads."""
    resolved = tuple(layer_ids or default_layer_ids(num_layers))
    check_layer_ids(resolved, num_layers)
    return resolved
