"""The training stage end to end: Ray Train workers (gloo, CPU) fed online by the real vLLM service."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raypipe.storage import Storage
from raypipe.train.launcher import run_training
from raypipe.train.loop import read_ledger
from tests.train.conftest import run_config

pytestmark = pytest.mark.integration


def _steps(run: Storage, epochs: int) -> list[dict]:
    steps = [s for e in range(epochs) for seg in read_ledger(run, e) for s in seg["steps"]]
    return sorted(steps, key=lambda s: s["step"])


def test_two_workers_train_online_and_the_loss_falls(prepared: Path, service, tmp_path: Path) -> None:
    cfg = run_config(prepared, tmp_path, "train.max_steps=200", "train.epochs=20", "train.checkpoint_every=100")
    result = run_training(cfg)
    assert result.error is None
    run = Storage(cfg.train.output, {})
    steps = _steps(run, cfg.train.epochs)
    assert [s["step"] for s in steps] == list(range(1, 201))
    first = sum(s["loss"] for s in steps[:20]) / 20
    last = sum(s["loss"] for s in steps[-20:]) / 20
    print(json.dumps({"first_loss": first, "last_loss": last, "last": steps[-1]}))
    assert last < 0.7 * first, (first, last)
    assert all(0 <= s["wait_fraction"] <= 1 and s["tokens_per_s"] > 0 for s in steps)
    # Every needs_response row got an on-policy reply, stored once for later epochs.
    replies = sum(pq.read_table(str(p)).num_rows for p in (Path(cfg.train.output) / "replies").glob("*.parquet"))
    manifest = json.loads((Path(cfg.data.output) / "manifest.json").read_text())
    assert replies == manifest["counts"]["needs_response"]
