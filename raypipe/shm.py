"""/dev/shm on a node of the service and the trainers: Ray's object store and the state files share it.

Ray puts its object store in /dev/shm, by default at 30% of the node's
memory capped at 95% of /dev/shm (`ray._private.utils.resolve_object_store_memory`,
so a container's `--shm-size` is almost all object store), and the service's
state files go there too (raypipe.serve.transport). A file that does not fit
fails its write, and the trainer asks again until the request times out. So
the state files' peak (raypipe.sizing.state_files_peak) must fit in what the
object store leaves: `raypipe doctor` checks this machine, each replica its
own node at start, and the cluster files set both sizes per node type
(`--shm-size` and `ray start --object-store-memory`).
"""

from __future__ import annotations

import os

GIB = 1 << 30
SHM = "/dev/shm"


def shm_bytes() -> int:
    """The size of /dev/shm (0 where there is none)."""
    if not os.path.isdir(SHM):
        return 0
    stat = os.statvfs(SHM)
    return stat.f_blocks * stat.f_frsize


def shm_shortfall(shm: int, object_store: int, peak: int) -> str | None:
    """Why the state files' `peak` does not fit beside an object store of `object_store` bytes in `shm` bytes of
    /dev/shm, with the fix; None when it fits. A store larger than /dev/shm is not there: Ray falls back to /tmp
    (`ray._private.services.determine_plasma_store_config`), slower, and leaves /dev/shm to the state files."""
    room = shm - object_store if object_store <= shm else shm
    if room >= peak:
        return None
    need = (object_store + peak) / GIB
    return (
        f"/dev/shm holds {shm / GIB:.1f} GiB and Ray's object store takes {object_store / GIB:.1f} GiB of it, "
        f"leaving {max(room, 0) / GIB:.2f} GiB for the state files, which need up to {peak / GIB:.2f} GiB "
        "(train.run.num_workers x (train.states.prefetch + 1) x train.schedule.step_tokens x state bytes per token). "
        f"Fix: give /dev/shm at least {need:.1f} GiB (docker run --shm-size={int(need) + 1}g, as cluster.yaml sets per "
        "node type), or start Ray with a smaller --object-store-memory, or lower train.states.prefetch"
    )


def check_node_shm(peak: int) -> None:
    """Refuse, with the numbers and the fix, a node whose /dev/shm cannot hold the state files' `peak` beside its
    object store (run by each service replica at start, on its own node)."""
    import ray

    shm = shm_bytes()
    if not shm or not peak:
        return  # no /dev/shm: states go through the object store (raypipe.serve.transport)
    node = ray.get_runtime_context().get_node_id()
    [store] = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["NodeID"] == node]
    problem = shm_shortfall(shm, int(store), peak)
    if problem is not None:
        raise ValueError(f"this node's {problem}")
