"""Anchors per row of a pack, as the DFlash paper draws them per sequence.

speculators' DFlash draws `max_anchors` positions uniformly over the whole
packed sequence, so a pack of several rows trains on fewer draft blocks per
row than the paper's 512 per sequence. Here each row keeps up to
`train.objective.max_anchors` of its supervised positions (all of them when it has
fewer), and a pack keeps at most `train.objective.max_pack_anchors`, a uniform sample of
its rows' anchors above that.

Cost model: a step drafts anchors x block_size query tokens. Each attends to
its row's context and its own block, and each gets draft and target logits
over the drafter's vocabulary. So compute grows with anchors x block_size x
(context + vocabulary), and memory with anchors x block_size x vocabulary x 2
logits tensors. The pack cap bounds that memory whatever the rows' lengths
(raypipe.sizing counts it).

The count is known on the host before the step, because the drafter's
forward sizes its mask tokens from it. The sample is drawn on the device
inside the drafter, and it is exactly that count: `install_row_anchors` hands
speculators' own anchor selection a loss mask thinned to the chosen positions
and nothing else. The loss still reads the full mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raypipe.compat.speculators import select_anchors_with


def anchor_count(loss_masks: list[np.ndarray], per_row: int, per_pack: int, block_size: int) -> int:
    """Anchors of a pack of rows (end to end, in order): each row's supervised positions up to `per_row`, the pack's
    last `block_size` positions excluded (speculators never anchors a block that would run off the pack), capped at
    `per_pack`; at least 1, an empty anchor being masked out of the loss."""
    valid = [int(np.count_nonzero(m)) for m in loss_masks]
    tail, cut = block_size, len(loss_masks) - 1
    while tail > 0 and cut >= 0:  # the pack's last positions, taken from the last rows backwards
        m = loss_masks[cut]
        take = min(tail, len(m))
        valid[cut] -= int(np.count_nonzero(m[len(m) - take :]))
        tail, cut = tail - take, cut - 1
    return max(1, min(per_pack, sum(min(per_row, v) for v in valid)))


def row_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor, per_row: int, count: int, block_size: int):
    """[1, T] bool: `count` anchor positions, up to `per_row` random supervised ones per row, then a uniform sample of
    those down to `count` (the pack cap). Random draws use torch's generator on the mask's device (seeded per rank and
    step by the loop)."""
    valid = loss_mask[0].bool().clone()
    valid[-block_size:] = False
    docs = document_ids[0]
    t = valid.numel()
    keys = torch.rand(t, device=valid.device)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))  # invalid positions rank last in their row
    # Rows are contiguous and in order in a pack, so ordering by (row, key) ranks each row's positions by key.
    order = torch.argsort(docs.to(torch.float64) * 4 + keys.to(torch.float64))
    sorted_docs = docs[order]
    rank = torch.arange(t, device=valid.device) - torch.searchsorted(sorted_docs, sorted_docs)
    keep = torch.zeros_like(valid)
    keep[order] = (rank < per_row) & valid[order]
    second = torch.where(keep, torch.rand(t, device=valid.device), torch.full_like(keys, 2.0))
    chosen = torch.zeros_like(valid)
    chosen[torch.topk(second, min(count, t), largest=False).indices] = True
    return (chosen & keep).unsqueeze(0)


def install_row_anchors(drafter: Any, per_row: int) -> None:
    """Make `drafter` (speculators' DFlashDraftModel, this instance only) draw its anchors per row.

    speculators draws them per pack; raypipe.compat.speculators.select_anchors_with replaces its draw.
    """
    select_anchors_with(
        drafter,
        lambda loss_mask, document_ids, max_anchors: row_anchor_mask(
            loss_mask, document_ids, per_row, max_anchors, drafter.block_size
        ),
    )
