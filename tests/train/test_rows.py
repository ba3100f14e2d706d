"""Training rows: stored on-policy replies replace placeholders; caches and replies refuse to mix runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raypipe.data.output import PreparedOutput
from raypipe.data.prepare import PREPARED_SCHEMA
from raypipe.storage import Storage
from raypipe.train.ledger import Ledger
from raypipe.train.rows import PreparedRows
from raypipe.train.states import StateCache, stream_states
from tests.helpers import local_target, serve_config

ROWS = [
    [
        {
            "sample_id": "a",
            "input_ids": [1, 2, 3, 4],
            "loss_mask": [0, 0, 1, 1],
            "needs_response": False,
            "prompt_len": 2,
        },
        {
            "sample_id": "b",
            "input_ids": [5, 6, 7, 8, 9],
            "loss_mask": [0, 0, 0, 0, 0],
            "needs_response": True,
            "prompt_len": 3,
        },
    ],
    [{"sample_id": "c", "input_ids": [10, 11], "loss_mask": [0, 1], "needs_response": False, "prompt_len": 1}],
]


def _prepared(root: Path, shards: list[list[dict]] = ROWS) -> PreparedOutput:
    """By default two shards: a trained row and a prompt-only row (prompt 3 tokens + placeholder 2) in the first, one
    row in the second."""
    files = []
    for i, shard in enumerate(shards):
        table = pa.Table.from_pylist(
            [
                {**r, "source": "s", "num_tokens": len(r["input_ids"]), "num_loss_tokens": sum(r["loss_mask"])}
                for r in shard
            ],
            schema=PREPARED_SCHEMA,
        )
        (root / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / "data" / f"part-{i:06d}.parquet")
        sha256 = hashlib.sha256((root / "data" / f"part-{i:06d}.parquet").read_bytes()).hexdigest()
        files.append({"file": f"data/part-{i:06d}.parquet", "rows": len(shard), "sha256": sha256})
    (root / "manifest.json").write_text(
        json.dumps({"shards": files, "end_of_turn": {"token": "<|im_end|>", "id": 151645}})
    )
    return PreparedOutput(str(root), {})


def test_replies_replace_placeholders_and_are_cut_to_max_length(tmp_path: Path) -> None:
    rows = PreparedRows(_prepared(tmp_path / "prepared"), Storage(str(tmp_path / "replies"), {}), max_length=6)
    assert rows.shards_needing_replies() == [0]
    positions, prompts = rows.prompts_of(0)
    assert (positions, prompts) == ([1], [[5, 6, 7]])  # the prompt only, without the placeholder reply
    rows.write_replies(0, positions, [[20, 21, 22, 23]])
    assert rows.shards_needing_replies() == []
    rows.load_replies()
    assert rows.lengths().tolist() == [4, 6, 2]
    b = rows.row(1)
    assert b.input_ids.tolist() == [5, 6, 7, 20, 21, 22] and b.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert rows.row(2).input_ids.tolist() == [10, 11] and rows.row(0).loss_mask.tolist() == [0, 0, 1, 1]


def test_rows_that_share_a_sample_id_keep_their_own_replies(tmp_path: Path) -> None:
    twins = [
        [
            {
                "sample_id": "dup",
                "input_ids": [5, 6, 7, 8],
                "loss_mask": [0] * 4,
                "needs_response": True,
                "prompt_len": 3,
            },
            {
                "sample_id": "dup",
                "input_ids": [9, 8, 7, 8],
                "loss_mask": [0] * 4,
                "needs_response": True,
                "prompt_len": 3,
            },
        ]
    ]
    rows = PreparedRows(_prepared(tmp_path / "prepared", twins), Storage(str(tmp_path / "replies"), {}), max_length=8)
    positions, prompts = rows.prompts_of(0)
    rows.write_replies(0, positions, [[30 + p[0]] for p in prompts])
    rows.load_replies()
    assert rows.row(0).input_ids.tolist() == [5, 6, 7, 35] and rows.row(1).input_ids.tolist() == [9, 8, 7, 39]


def test_replies_of_another_target_or_sampling_are_refused(tmp_path: Path) -> None:
    rows = PreparedRows(_prepared(tmp_path / "prepared"), Storage(str(tmp_path / "replies"), {}), max_length=6)
    rows.check_replies_meta({"target": "t", "sampling": {"temperature": 0.0}}, write=True)
    rows.check_replies_meta({"target": "t", "sampling": {"temperature": 0.0}}, write=True)
    with pytest.raises(ValueError, match="new train.output"):
        rows.check_replies_meta({"target": "t", "sampling": {"temperature": 1.0}}, write=True)


def test_missing_prepared_data_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="raypipe prepare"):
        PreparedOutput(str(tmp_path), {}).manifest_bytes()


def test_state_cache_keys_by_tokens_and_refuses_other_layers(tmp_path: Path) -> None:
    cache = StateCache(Storage(str(tmp_path / "cache"), {}), serve_config("builtin:tiny"), [1, 4])
    ids = np.array([3, 4, 5])
    states = torch.randn(3, 2, 8)
    assert cache.get(ids) is None
    cache.put(ids, states)
    torch.testing.assert_close(cache.get(ids), states.to(torch.bfloat16))
    assert cache.get(np.array([3, 4, 6])) is None
    with pytest.raises(ValueError, match="holds states of"):
        StateCache(Storage(str(tmp_path / "cache"), {}), serve_config("builtin:tiny"), [2, 4])
    with pytest.raises(ValueError, match="hybrid"):
        list(stream_states([[ids], [np.array([9])]], "offline", None, cache))


def test_state_cache_refuses_states_of_another_dtype_or_of_the_targets_older_weights(tmp_path: Path) -> None:
    target = local_target(tmp_path / "target")
    storage = Storage(str(tmp_path / "cache"), {})
    StateCache(storage, serve_config(str(target)), [1, 4]).put(np.array([3, 4, 5]), torch.randn(3, 2, 8))
    StateCache(storage, serve_config(str(target)), [1, 4])  # the same target, dtype and layers: reused
    with pytest.raises(ValueError, match="holds states of .*point train.states.cache at a new directory"):
        StateCache(storage, serve_config(str(target), dtype="bfloat16"), [1, 4])
    local_target(target, scale=2.0)  # updated in place: the same serve.model
    with pytest.raises(ValueError, match="holds states of .*point train.states.cache at a new directory"):
        StateCache(storage, serve_config(str(target)), [1, 4])


def test_replies_of_the_targets_older_weights_are_refused(tmp_path: Path) -> None:
    from raypipe.config import load_config
    from raypipe.train.replies import open_rows

    _prepared(tmp_path / "prepared")
    target = local_target(tmp_path / "target")
    cfg = load_config(
        "debug_cpu", [f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", f"serve.model={target}"]
    )
    open_rows(cfg)
    open_rows(cfg)  # the same target: its replies are reused
    local_target(target, scale=2.0)  # updated in place: the same serve.model
    with pytest.raises(ValueError, match="holds replies made with .*use a new train.output"):
        open_rows(cfg)


def test_replies_sampled_with_another_top_p_are_refused(tmp_path: Path) -> None:
    from raypipe.config import load_config
    from raypipe.train.replies import open_rows

    _prepared(tmp_path / "prepared")
    target = local_target(tmp_path / "target")
    common = [f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", f"serve.model={target}"]
    open_rows(load_config("debug_cpu", [*common, "train.replies.temperature=1.0"]))
    open_rows(load_config("debug_cpu", [*common, "train.replies.temperature=1.0", "train.replies.top_p=1.0"]))
    refused = "holds replies made with .*'top_p': 1.0.*not .*'top_p': 0.9.*new train.output"
    with pytest.raises(ValueError, match=refused):
        open_rows(load_config("debug_cpu", [*common, "train.replies.temperature=1.0", "train.replies.top_p=0.9"]))


def test_ledger_forgets_segments_after_the_resumed_cursor(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ledger"), {})
    ledger = Ledger(storage, rank=0)
    for start, end in ((0, 4), (4, 8), (8, 12)):
        ledger.add(0, start, [f"s{start}"])
        ledger.flush(end)
    ledger.add(1, 0, ["t"])
    ledger.flush(2)
    ledger.drop_after(0, 4)  # resumed from the checkpoint at cursor 4 of epoch 0
    assert storage.glob("*/*.json") == ["epoch-0000/packs-000000000-000000004.rank-0000.json"]


def test_storage_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "x"), {})
    storage.write("a/b.bin", b"123")
    assert storage.read("a/b.bin") == b"123" and storage.glob("a/*") == ["a/b.bin"]
    assert not list((tmp_path / "x" / "a").glob("*.tmp-*"))
