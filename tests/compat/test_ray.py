"""Ray 2.60's private names that raypipe.compat.ray reads still mean what raypipe relies on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe.compat.ray import (
    checkpoint_snapshot_filename,
    current_cluster_file,
    default_object_store_memory,
    metrics_report_interval_s,
)
from raypipe.ray_head import head_to_join


def test_the_object_store_takes_a_share_of_memory_capped_by_dev_shm() -> None:
    """What raypipe.shm counts the object store as, where `ray start` has no --object-store-memory: 30% of available
    memory, at most 95% of /dev/shm (a container's --shm-size)."""
    import psutil
    from ray._private.utils import get_shared_memory_bytes

    store = default_object_store_memory()
    assert 0 < store <= 0.3 * psutil.virtual_memory().total
    assert store <= max(0.95 * get_shared_memory_bytes(), 10**10)  # Ray never caps below 10 GB


def test_ray_train_restores_a_run_only_from_a_folder_with_the_checkpoint_snapshot(tmp_path: Path) -> None:
    from ray.train import Result

    with pytest.raises(RuntimeError, match=f"{checkpoint_snapshot_filename()} doesn't exist"):
        Result.from_path(str(tmp_path))


def test_the_metrics_report_interval_is_rays_config_in_effect() -> None:
    code = "from raypipe.compat.ray import metrics_report_interval_s; print(metrics_report_interval_s())"
    env = {**os.environ, "RAY_metrics_report_interval_ms": "2500"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2.5"]
    assert metrics_report_interval_s() > 0


def test_the_head_ray_init_joins_is_the_one_raypipe_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """raypipe.ray_head's rule against Ray's own (what `ray.init()` without an address joins), with the current-cluster
    file under RAY_TMPDIR: this machine's /tmp/ray/ray_current_cluster belongs to the Ray instances running on it."""
    from ray._private.services import canonicalize_bootstrap_address

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    recorded = current_cluster_file()
    assert recorded == tmp_path / "ray" / "ray_current_cluster"

    def joined() -> tuple[str | None, str | None]:
        head = head_to_join(os.environ, recorded)
        return canonicalize_bootstrap_address(None), head and head.address

    assert joined() == (None, None)  # nothing recorded: a local instance
    recorded.parent.mkdir()
    recorded.write_text("10.0.0.5:6379")  # what `ray start --head` writes
    assert joined() == ("10.0.0.5:6379", "10.0.0.5:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.6:6380")
    assert joined() == ("10.0.0.6:6380", "10.0.0.6:6380")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert joined() == (None, None)
