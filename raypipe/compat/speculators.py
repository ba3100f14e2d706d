"""speculators 0.9.0's private methods of `DFlashDraftModel` (speculators/models/dflash/core.py) that raypipe calls.

On an upgrade: run tests/compat/test_speculators.py, and read core.py's `from_training_args`,
`_build_attention_mask` and `_backbone_forward` (and utils.py's `select_anchors`) against the docstrings below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def build_base_config_kwargs(layer_config: Any, **kwargs: Any) -> dict[str, Any]:
    """`DFlashDraftModel._build_base_config_kwargs("dflash", layer_config, **kwargs)`: the `DFlashSpeculatorConfig`
    keyword arguments that `from_training_args` builds, without the weights it then reads.

    Relies on (0.9.0): the static method takes (algorithm, verifier_config, **training kwargs), reads
    `verifier_name_or_path`, `target_layer_ids`, `draft_vocab_size`, `block_size`, `mask_token_id`,
    `draft_attn_impl` and `sliding_window_non_causal`, and returns a dict that `DFlashSpeculatorConfig(**kwargs)`
    accepts. On an upgrade check that each of those keys is still read under that name.
    """
    from speculators.models.dflash import DFlashDraftModel

    return DFlashDraftModel._build_base_config_kwargs("dflash", layer_config, **kwargs)  # noqa: SLF001


def select_anchors_with(drafter: Any, choose: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> None:
    """Make `drafter` (this instance only) anchor its draft blocks at exactly the positions
    `choose(loss_mask, document_ids, max_anchors)` marks ([1, T] bool, at most `max_anchors` of them).

    Relies on (0.9.0): `DFlashDraftModel.forward` and `_backbone_forward` get their anchors from
    `self._build_attention_mask(loss_mask, max_anchors, document_ids, device)`, which reads the loss mask only to
    select anchors (`select_anchors`: a random `max_anchors` of its positions outside the last `block_size`); given
    the chosen positions as its mask and their count, that selection takes exactly them. On an upgrade check that
    the method keeps that name and signature and that the loss mask still plays no other part in it.
    """
    build = drafter._build_attention_mask  # noqa: SLF001

    @torch.compiler.disable
    def build_chosen(loss_mask: torch.Tensor, max_anchors: int, document_ids: torch.Tensor, device: Any) -> Any:
        chosen = choose(loss_mask, document_ids, max_anchors)
        return build(chosen.to(loss_mask.dtype), max_anchors, document_ids, device)

    drafter._build_attention_mask = build_chosen  # noqa: SLF001


def block_logits(
    drafter: Any,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    verifier_last_hidden_states: torch.Tensor,
    document_ids: torch.Tensor,
    max_anchors: int,
) -> torch.Tensor:
    """The drafter's logits for the draft block after each anchor, without its loss: [1, max_anchors * block_size,
    draft vocab], block by block in ascending anchor order (slot 0 of a block is the anchor itself).

    Relies on (0.9.0): `_backbone_forward(hidden_states, input_ids, loss_mask, verifier_last_hidden_states,
    document_ids, max_anchors=...)` returns `(hidden, logits, targets, aligned_loss_mask, anchored_block_indices)`
    and, with at most `max_anchors` positions in `loss_mask`, anchors at every one of them, sorted. On an upgrade
    check the returned tuple's order and that the anchors still come sorted.
    """
    _, logits, _, _, _ = drafter._backbone_forward(  # noqa: SLF001
        hidden_states=hidden_states,
        input_ids=input_ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=verifier_last_hidden_states,
        document_ids=document_ids,
        max_anchors=max_anchors,
    )
    return logits
