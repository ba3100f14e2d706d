"""A data stage resumed on S3 (the real local S3 server) in a process whose s3fs instance cached stale listings."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from raypipe.config import DataConfig
from raypipe.data.output import PreparedOutput
from raypipe.data.pipeline import run_prepare

pytestmark = pytest.mark.integration
PREFIX = "raypipe/s3resume"


def test_a_resumed_prepare_on_s3_redoes_the_lost_shard_and_writes_the_right_manifest(
    ray_cluster, tmp_path: Path, s3_server, capsys
) -> None:
    fs = fsspec.filesystem(
        "s3", **s3_server
    )  # the instance fsspec hands every Storage of this process (cached per options)
    rows = [
        {
            "id": f"r{i}",
            "messages": [
                {"role": "user", "content": f"question {i} " * (i % 7 + 1)},
                {"role": "assistant", "content": f"answer {i}"},
            ],
        }
        for i in range(120)
    ]
    for name, part in (("a", rows[:70]), ("b", rows[70:])):
        fs.pipe_file(f"{PREFIX}/in/{name}.jsonl", "".join(json.dumps(r) + "\n" for r in part).encode())
    cfg = DataConfig.model_validate(
        {
            "sources": [{"path": f"s3://{PREFIX}/in/*.jsonl", "name": "mixed"}],
            "output": f"s3://{PREFIX}/prepared",
            "storage_options": s3_server,
            "tokenizer": "builtin:qwen",
            "chat_template": "qwen_strict",
            "max_length": 64,
            "chunk_bytes": 2048,
            "num_actors": 1,
            "cpus_per_actor": 0.5,
        }
    )
    first = run_prepare(cfg)
    assert len(first["shards"]) >= 4 and first["counts"]["rows_kept"] == len(rows)

    # This process lists the whole output (its instance now caches every folder with every file), then a run elsewhere
    # is
    # killed: one shard's completion mark and the manifest are gone, deleted by another process's client.
    assert f"{PREFIX}/prepared/stats/part-000002.json" in fs.find(f"{PREFIX}/prepared")
    other = fsspec.filesystem("s3", skip_instance_cache=True, **s3_server)
    other.rm([f"{PREFIX}/prepared/stats/part-000002.json", f"{PREFIX}/prepared/manifest.json"])
    capsys.readouterr()

    resumed = run_prepare(cfg)
    assert (
        f"{len(first['shards']) - 1} already complete, 1 to do" in capsys.readouterr().out
    )  # the lost shard, and only it
    assert resumed == first
    assert json.loads(other.cat_file(f"{PREFIX}/prepared/manifest.json")) == first
    assert other.exists(f"{PREFIX}/prepared/stats/part-000002.json") and not other.glob(f"{PREFIX}/prepared/**/*.tmp-*")


def test_resume_checks_see_what_another_process_wrote_or_deleted_since_a_listing(s3_server) -> None:
    out = PreparedOutput(f"s3://{PREFIX}/checks", s3_server)
    other = fsspec.filesystem("s3", skip_instance_cache=True, **s3_server)  # another process's client
    for shard in (0, 1):
        out.write(f"stats/part-00000{shard}.json", b"{}\n")
    assert len(out.glob("stats/*.json")) == 2  # this process lists the output: the shared instance caches the folder
    other.rm(f"{PREFIX}/checks/stats/part-000001.json")
    other.pipe_file(f"{PREFIX}/checks/stats/part-000002.json", b'{"shard": 2}\n')
    assert out.is_done(1) and not out.is_done(2), "s3fs answers from its cached listing"  # the hazard refresh() removes

    out.refresh()
    assert [out.is_done(s) for s in (0, 1, 2)] == [True, False, True]
    assert out.read_json("stats/part-000002.json") == {"shard": 2}
