"""The draft vocabulary: counted on the supervised tokens as trained, mapped as speculators and vLLM read it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from raypipe.config import ServeConfig, TrainConfig
from raypipe.eval.offline import drafted_blocks
from raypipe.storage import Storage
from raypipe.target import resolve_target
from raypipe.train.drafter import build_drafter
from raypipe.train.rows import PreparedRows
from raypipe.train.vocab import supervised_counts, vocab_from_counts
from tests.train.test_rows import _prepared


def test_counts_take_the_supervised_tokens_and_the_replies_not_the_placeholders(tmp_path: Path) -> None:
    rows = PreparedRows(_prepared(tmp_path / "prepared"), Storage(str(tmp_path / "replies"), {}), max_length=5)
    rows.write_replies(0, [1], [[20, 20, 21]])  # cut to max_length: prompt 3 + 2 reply tokens
    rows.load_replies()
    counts = supervised_counts(rows, 32, chunk_rows=2)  # two chunks
    assert {int(t): int(counts[t]) for t in np.flatnonzero(counts)} == {3: 1, 4: 1, 20: 2, 11: 1}


def test_the_most_frequent_tokens_are_kept_ties_to_the_lower_id_and_the_offsets_give_target_ids() -> None:
    counts = np.zeros(10, np.int64)
    counts[[7, 2, 5, 9]] = [5, 3, 3, 1]
    vocab = vocab_from_counts(counts, 3)
    kept = (torch.arange(3) + vocab.d2t).tolist()
    assert kept == [2, 5, 7] and vocab.t2d.nonzero().squeeze(-1).tolist() == kept and vocab.t2d.dtype == torch.bool
    filled = vocab_from_counts(counts, 6)  # fewer distinct tokens than asked: the lowest unused ids fill it
    assert (torch.arange(6) + filled.d2t).tolist() == [0, 1, 2, 5, 7, 9]
    with pytest.raises(ValueError, match=r"train\.drafter\.draft_vocab_size=11 must be in \[1, 10\]"):
        vocab_from_counts(counts, 11)


def test_a_reduced_drafter_keeps_the_targets_head_rows_saves_the_mapping_and_drafts_target_ids(
    tiny_target: str, tmp_path: Path
) -> None:
    target = resolve_target(ServeConfig(model=tiny_target, num_gpus=0, resource=None, kv_cache_gib=1))
    full = target.shape.vocab_size
    counts = np.zeros(full, np.int64)
    counts[np.arange(100, 100 + 3 * 300, 3)] = np.arange(300, 0, -1)  # 300 supervised tokens, spread over the ids
    vocab = vocab_from_counts(counts, 256)
    tc = TrainConfig(
        output="unused", drafter={"draft_layers": 1, "block_size": 4, "draft_vocab_size": 256}, run={"use_gpu": False}
    )
    drafter = build_drafter(target, tc, vocab)
    head = load_file(f"{target.path}/model.safetensors")["lm_head.weight"]
    assert drafter.lm_head.weight.shape == (256, target.shape.hidden_size)
    assert torch.equal(drafter.lm_head.weight, head[vocab.t2d])

    drafter.save_pretrained(tmp_path / "export")  # what vLLM loads: the mapping and the reduced head travel with it
    saved = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert torch.equal(saved["d2t"], vocab.d2t) and saved["lm_head.weight"].shape[0] == 256

    t = 24
    ids = torch.randint(0, full, (1, t))
    mask = torch.zeros_like(ids)
    mask[0, 4:16] = 1
    states = torch.randn(t, len(target.layer_ids), target.shape.hidden_size)  # as served: [T, layers, hidden]
    _, drafted = drafted_blocks(drafter.eval(), ids, states, mask)
    kept = set((torch.arange(256) + vocab.d2t).tolist())
    assert drafted.numel() > 0 and set(drafted.flatten().tolist()) <= kept  # target ids, all from the draft vocabulary
