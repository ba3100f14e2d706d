"""The plan a resumed run keeps: its chunks read back as planned, an older plan's refused by name."""

from __future__ import annotations

import json

import pytest

from raypipe.data.output import PreparedOutput
from raypipe.data.sources import Chunk, FileRange

DEPS = {"raypipe_version": "0.1.0", "config_hash": "c", "tokenizer_hash": "t", "template_hash": "h", "inputs": {}}


def test_a_resumed_run_gets_its_planned_chunks_back(tmp_path):
    chunks = [
        Chunk(
            0, "mix", "auto", (FileRange("/in/a.jsonl", "jsonl", 0, 40), FileRange("/in/b.parquet", "parquet", 0, 1))
        ),
        Chunk(1, "mix", "auto", (FileRange("/in/c.jsonl.gz", "jsonl.gz", 0, 9),)),
    ]
    (tmp_path / "plan.json").write_text(json.dumps({**DEPS, "chunks": [c.to_dict() for c in chunks]}))
    output = PreparedOutput(str(tmp_path), {})
    assert output.planned_chunks(DEPS) == chunks
    assert output.planned_chunks({**DEPS, "config_hash": "other"}) is None


def test_a_plan_of_one_file_range_per_shard_is_refused_with_the_fix(tmp_path):
    old = {"index": 0, "source": "mix", "format": "auto", "url": "/in/a.jsonl", "kind": "jsonl", "start": 0, "end": 40}
    (tmp_path / "plan.json").write_text(json.dumps({**DEPS, "chunks": [old]}))
    with pytest.raises(ValueError, match="planned by an earlier raypipe.*set a new data.output"):
        PreparedOutput(str(tmp_path), {}).planned_chunks(DEPS)
