"""Ray 2.60's private modules and config that raypipe reads (`ray._private`, `ray.train.v2._internal`, `ray._config`).

On an upgrade: run tests/compat/test_ray.py, and check the names below still exist with the meaning described.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def default_object_store_memory() -> int:
    """The object store `ray start` gives this node when told no size: 30% of its available memory
    (RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION), at most 200 GB and 95% of /dev/shm.

    Relies on (2.60): `ray._private.utils.resolve_object_store_memory(estimate_available_memory())`, as
    `ray._private.resource_and_label_spec` resolves a node's resources.
    """
    from ray._private.utils import estimate_available_memory, resolve_object_store_memory

    return resolve_object_store_memory(estimate_available_memory())


def current_cluster_file() -> Path:
    """The file in which `ray start --head` records its GCS address, and from which `ray.init()` joins that head when
    it is given no address and RAY_ADDRESS is unset (or `auto`); `ray stop` removes it. It is
    `{RAY_TMPDIR, else TMPDIR, else /tmp}/ray/ray_current_cluster`.

    Relies on (2.60): `ray._common.utils.get_ray_address_file(None)`, which `ray.init` reads through
    `ray._private.services.canonicalize_bootstrap_address` -> `get_ray_address_from_environment` (RAY_ADDRESS first,
    `local` starting a new instance).
    """
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


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
