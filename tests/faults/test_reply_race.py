"""The reply pass with engines of different speeds, forced by a deterministic delay, and with an engine stuck on a
shard.

The real run_replies drives real vLLM CPU engines (ReplyWriter) on the tiny
target; the test swaps in a subclass whose `write` first waits, for one shard,
until every other shard's replies are stored (the slow engine), or never
returns (the stuck engine). The issue's race was shards owned by no rank and
ranks polling forever; here the driver alone hands out shards.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from raypipe.data.output import shard_name
from raypipe.train import replies
from raypipe.train.replies import ReplyWriter, open_rows, run_replies
from tests.train.helpers import prepare_sample, run_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prepared_shards(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample's prompt-only rows among others, prepared in small shards (several need replies)."""
    root = tmp_path_factory.mktemp("reply_race")
    prepare_sample(root, 160, 120, "data.chunk_bytes=32768")
    return root


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
    prepared_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = run_config(prepared_shards, tmp_path, "data.chunk_bytes=32768", "serve.max_replicas=2")
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


def test_a_stuck_shard_fails_the_pass_naming_it_and_a_rerun_does_only_the_rest(
    prepared_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = run_config(
        prepared_shards, tmp_path, "data.chunk_bytes=32768", "serve.max_replicas=1", "train.run.reply_timeout_s=60"
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
