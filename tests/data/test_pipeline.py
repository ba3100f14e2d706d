"""The data stage on a real local Ray cluster: actors, shards, resume, kill, S3."""

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from raypipe.config import DataConfig
from raypipe.data.pipeline import run_prepare
from tests.data.bad_corpus import BAD_ROWS, MAX_ROW_BYTES, corpus_lines
from tests.helpers import scrape_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def good_records(n: int, seed: int = 0) -> list[dict]:
    out = []
    for i in range(n):
        words = " ".join(f"w{(i * 7 + j) % 97}" for j in range(5 + (i * 13 + seed) % 60))
        if i % 4 == 0:
            out.append({"id": f"p{i}", "messages": [{"role": "user", "content": f"Prompt {i}: {words}"}]})
        elif i % 4 == 1:
            out.append(
                {"conversations": [{"from": "human", "value": f"Q{i} {words}"}, {"from": "gpt", "value": words}]}
            )
        elif i % 4 == 2:
            out.append({"instruction": f"Task {i}", "input": words, "output": words[::-1]})
        else:
            out.append(
                {
                    "id": f"m{i}",
                    "messages": [
                        {"role": "user", "content": "a"},
                        {"role": "assistant", "content": words},
                        {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"},
                    ],
                }
            )
    return out


def write_inputs(root: Path, n: int = 1200) -> Path:
    """JSONL with bad rows, JSONL.gz and Parquet with two row groups."""
    root.mkdir(parents=True, exist_ok=True)
    records = good_records(n)
    lines = corpus_lines() + [json.dumps(r).encode() for r in records[: n // 2]]
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(root / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records[n // 2 : 3 * n // 4]))
    table = pa.Table.from_pylist(
        [
            {"instruction": r["instruction"], "input": r["input"], "output": r["output"]}
            for r in records
            if "instruction" in r
        ]
    )
    pq.write_table(table, root / "c.parquet", row_group_size=table.num_rows // 2 + 1)
    return root


def config(inputs: Path, output: Path, **extra) -> DataConfig:
    return DataConfig.model_validate(
        {
            "sources": [{"path": str(inputs / "*"), "name": "mixed"}],
            "output": str(output),
            "tokenizer": "builtin:qwen",
            "chat_template": "qwen_strict",
            "chunk_bytes": 16384,
            "max_row_bytes": MAX_ROW_BYTES,
            "max_length": 64,
            "num_actors": 2,
            "cpus_per_actor": 0.5,
            **extra,
        }
    )


def test_prepare_writes_shards_manifest_and_rejects_then_resumes_identically(ray_cluster, tmp_path):
    inputs = write_inputs(tmp_path / "in")
    cfg = config(inputs, tmp_path / "out")
    manifest = run_prepare(cfg)
    c = manifest["counts"]
    assert c["rows_in"] + c["split_extra"] == c["rows_kept"] + c["rows_rejected"]
    assert c["rows_rejected"] >= len(BAD_ROWS)
    assert len(manifest["shards"]) > 4
    assert sum(s["rows"] for s in manifest["shards"]) == c["rows_kept"]
    assert manifest["rejects_by_code"]["invalid_utf8"] == 1
    rejects = [
        json.loads(line)
        for p in sorted((tmp_path / "out/rejects").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert len(rejects) == c["rows_rejected"] and all(r["reason"] for r in rejects)

    ds = ray.data.read_parquet(str(tmp_path / "out/data"))
    assert ds.count() == c["rows_kept"]
    row = ds.take(1)[0]
    assert set(row) == {
        "sample_id",
        "source",
        "input_ids",
        "loss_mask",
        "num_tokens",
        "num_loss_tokens",
        "needs_response",
        "prompt_len",
    }
    assert row["source"] == "mixed"
    assert sum(manifest["token_histogram"]["rows"]) == c["rows_kept"]

    before = {p.name: p.read_bytes() for p in (tmp_path / "out/data").iterdir()}
    again = run_prepare(cfg)  # every shard complete: nothing redone, same manifest
    assert again == manifest
    assert {p.name: p.read_bytes() for p in (tmp_path / "out/data").iterdir()} == before

    with pytest.raises(ValueError, match="different config"):
        run_prepare(config(inputs, tmp_path / "out", max_length=65))

    names = [
        "ray_raypipe_data_rows_total",
        "ray_raypipe_data_rows_kept_total",
        "ray_raypipe_data_tokens_total",
        "ray_raypipe_data_rejects_total",
    ]
    metrics = scrape_metrics(ray_cluster, names)
    assert all(metrics.values()), f"not exported: {[n for n, v in metrics.items() if not v]}"
    assert any('source="mixed"' in line for line in metrics["ray_raypipe_data_rows_total"])
    assert any('reason="invalid_utf8"' in line for line in metrics["ray_raypipe_data_rejects_total"])


def test_each_actor_sizes_the_tokenizer_thread_pool_to_its_cpus(ray_cluster, tmp_path):
    """The pool is sized from `data.cpus_per_actor` in the actor's constructor, not by a runtime_env (which would keep
    the actor off Ray's idle workers). Its threads are those the first shard starts under the calling thread's name (a
    new thread inherits it; Ray's own threads have their own names and come and go)."""
    from raypipe.data.pipeline import _PrepareActor
    from raypipe.data.sources import plan_chunks
    from raypipe.data.tokenizer import resolve_tokenizer

    inputs = write_inputs(tmp_path / "in", n=200)
    cfg = {n: config(inputs, tmp_path / "out", cpus_per_actor=n) for n in (1, 3)}
    [every_file] = plan_chunks(cfg[1].sources, {}, 1 << 30)
    # a.jsonl alone: reading the Parquet file would start Arrow's threads, named like this one too
    chunk = json.dumps(dataclasses.replace(every_file, files=every_file.files[:1]).to_dict())
    spec = [ray.put(resolve_tokenizer(cfg[1])[1])]

    @ray.remote(num_cpus=0.5)
    class Actor(_PrepareActor):
        def threads_started_by_a_shard(self) -> int:
            def named_like_this_thread() -> int:
                me = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
                return sum(t.read_text() == me for t in Path("/proc/self/task").glob("*/comm"))

            before = named_like_this_thread()
            self({"chunk": [chunk]})
            return named_like_this_thread() - before

    started = {
        n: ray.get(Actor.remote(cfg[n].model_dump_json(), spec).threads_started_by_a_shard.remote()) for n in (1, 3)
    }
    assert started == {1: 1, 3: 3}


def test_a_shard_whose_rows_are_all_rejected_is_written_and_counted(ray_cluster, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "bad.jsonl").write_text('{"messages": []}\n{"prompt": "no known format"}\n')
    manifest = run_prepare(config(inputs, tmp_path / "out"))
    assert manifest["counts"]["rows_kept"] == 0 and manifest["counts"]["rows_rejected"] == 2
    assert sum(manifest["rejects_by_code"].values()) == 2


def test_killed_run_resumes_to_identical_output(ray_cluster, tmp_path):
    inputs = write_inputs(tmp_path / "in", n=3000)
    reference = run_prepare(config(inputs, tmp_path / "ref"))

    out = tmp_path / "killed"
    overrides = [
        f"data.sources=[{{path: '{inputs}/*', name: mixed}}]",
        f"data.output={out}",
        "data.chunk_bytes=16384",
        f"data.max_row_bytes={MAX_ROW_BYTES}",
        "data.max_length=64",
        "data.num_actors=1",
        "data.cpus_per_actor=0.5",
    ]
    cmd = [sys.executable, "-m", "raypipe.cli", "prepare", "--recipe", "debug_cpu", *overrides]
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while len(list((out / "stats").glob("*.json"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list((out / "stats").glob("*.json")))
    assert 3 <= done < len(reference["shards"]) and not (out / "manifest.json").exists()

    resumed = run_prepare(config(inputs, out, num_actors=1))
    assert resumed == reference
    for shard in reference["shards"]:
        assert (out / shard["file"]).read_bytes() == (tmp_path / "ref" / shard["file"]).read_bytes()
        assert (out / shard["rejects"]).read_bytes() == (tmp_path / "ref" / shard["rejects"]).read_bytes()
    assert not list(out.rglob("*.tmp-*"))


def test_reads_and_writes_s3(ray_cluster, tmp_path, s3_server):
    import fsspec

    inputs = write_inputs(tmp_path / "in", n=200)
    fs = fsspec.filesystem("s3", **s3_server)
    for p in inputs.iterdir():
        fs.put_file(str(p), f"raypipe/in/{p.name}")
    cfg = DataConfig.model_validate(
        {
            **config(inputs, tmp_path).model_dump(),
            "sources": [{"path": "s3://raypipe/in/*", "name": "mixed"}],
            "output": "s3://raypipe/prepared",
            "storage_options": s3_server,
        }
    )
    manifest = run_prepare(cfg)
    local = run_prepare(config(inputs, tmp_path / "local"))
    assert manifest["counts"] == local["counts"]
    for remote, mine in zip(
        manifest["shards"], local["shards"]
    ):  # ids of rows without one hash the file URL, so differ
        with fs.open(f"raypipe/prepared/{remote['file']}", "rb") as f:
            got = pq.read_table(f).drop_columns(["sample_id"])
        assert got.equals(pq.read_table(tmp_path / "local" / mine["file"]).drop_columns(["sample_id"]))
    with fs.open("raypipe/prepared/manifest.json") as f:
        assert json.load(f) == manifest
    assert not fs.glob("raypipe/prepared/**/*.tmp-*")
