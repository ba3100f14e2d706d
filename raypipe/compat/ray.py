"""Ray 2.60's private modules and config that raypipe reads (`ray._private`, `ray.train.v2._internal`, `ray._config`).

On an upgrade: run tests/compat/test_ray.py, and check the names below still exist with the meaning described.
"""

from __future__ import annotations

from typing import Any


def object_store_memory_proportion() -> float:
    """The share of a node's memory Ray's object store takes by default (0.3; RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION
    overrides it).

    Relies on (2.60): `ray._private.ray_constants.DEFAULT_OBJECT_STORE_MEMORY_PROPORTION`, which
    `ray._private.utils.resolve_object_store_memory` multiplies the node's memory by when no size is given.
    """
    from ray._private.ray_constants import DEFAULT_OBJECT_STORE_MEMORY_PROPORTION

    return DEFAULT_OBJECT_STORE_MEMORY_PROPORTION


def checkpoint_snapshot_filename() -> str:
    """The file in a Ray Train run's folder that says it has recorded checkpoints (and what a restore reads).

    Relies on (2.60): `ray.train.v2._internal.constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME`
    ("checkpoint_manager_snapshot.json"), the file without which `ray.train.Result.from_path` refuses the folder.
    """
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    return CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def metrics_report_interval_s() -> float:
    """How often this process exports its `ray.util.metrics` values, in seconds.

    Relies on (2.60): `ray._config.metrics_report_interval_ms()`, Ray's system config in milliseconds (10 000 by
    default, RAY_metrics_report_interval_ms overrides it).
    """
    import ray

    return ray._config.metrics_report_interval_ms() / 1000  # noqa: SLF001


def record_zero(counter: Any, tags: dict[str, str]) -> None:
    """Export `counter` at 0 for `tags` before anything is counted (Grafana shows "no data" for a series it never saw).

    Relies on (2.60): `ray.util.metrics.Counter._record(value, tags)`, the recorder under `inc`, which takes 0 where
    `inc(0)` raises ValueError (tests/test_counters.py reads the exported 0 on a real cluster).
    """
    counter._record(0, tags)
