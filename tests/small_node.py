"""A small memory node for one command: a real cgroup memory limit, which vLLM's CPU backend reads as its node's size.

vLLM (and raypipe.node_memory, which mirrors it) clamps the NUMA node's total
and available memory to the cgroup limit at
/sys/fs/cgroup/memory/memory.limit_in_bytes. The command runs in a child of
this process's memory cgroup, limited to the size asked for, inside a mount
namespace of its own where that child is bound over /sys/fs/cgroup/memory:
the command and every process it starts see the limit as their node's memory,
and the kernel enforces it. It needs root, `unshare` and a writable cgroup v1
memory hierarchy, as on the CI machine. From the shell:

    python -m tests.small_node 8 -- .venv/bin/python jobs/pipeline.py --recipe demo
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")  # cgroup v1, where vLLM reads the limit


def own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_MEMORY / path.lstrip("/")
    return None


def unavailable() -> str | None:
    """Why no small node can be made here; None when one can."""
    cgroup = own_memory_cgroup()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a small node needs root and unshare"
    if cgroup is None or not (cgroup / "memory.limit_in_bytes").exists() or not os.access(cgroup, os.W_OK):
        return "a small node needs a writable cgroup v1 memory hierarchy"
    return None


@contextmanager
def small_node(gib: float) -> Iterator[list[str]]:
    """The prefix that runs a command on a node of `gib` GiB; the cgroup goes when the block ends."""
    cgroup = own_memory_cgroup() / f"raypipe-small-node-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(int(gib * (1 << 30))))
        enter = f'echo $$ > {cgroup}/cgroup.procs && mount --bind {cgroup} {CGROUP_MEMORY} && exec "$@"'
        yield ["unshare", "--mount", "sh", "-c", enter, "small-node"]
    finally:
        cgroup.rmdir()


if __name__ == "__main__":
    size, separator, *command = sys.argv[1:]
    assert separator == "--" and command, "usage: python -m tests.small_node GIB -- COMMAND..."
    with small_node(float(size)) as prefix:
        sys.exit(subprocess.run(prefix + command).returncode)
