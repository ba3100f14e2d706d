"""The vLLM engine processes raypipe starts, ended by their pids when their owner ends.

vLLM runs its engine core (and, with tensor parallelism, its workers) in
processes of their own, children of the process that starts the engine (a
Serve replica, a reply-pass actor, an evaluation task). A clean shutdown stops
them. Ray ends the processes of a worker killed hard once its raylet notices,
but nothing does after `ray stop --force` or when the raylet itself died: they
keep running, re-parented, holding memory, cores or GPUs. So the owner
records what the engine's start left running, pid and start time, in
`<node registry>/<owner pid>.<pid namespace>.json` (shared memory, one registry
per node and user); it ends them itself when it closes the engine, and whoever
starts an engine next on that node, or a live replica every minute, ends those
whose owner is gone. A process is ended only when both its pid and its start
time match the record, so a reused pid is never taken for an engine, and no
process is ever found by its name. Pids mean something only in their own pid
namespace, and containers sharing /dev/shm may each have their own: a record
is judged only in the namespace that wrote it (others' are passed over), and
one that names none (written before records named one) is no record here.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from raypipe.serve.transport import memory_dir, pid_namespace

REGISTRY = "raypipe-engines"
GRACE_S = 10.0  # SIGTERM first: vLLM's engine core shuts down cleanly on it; SIGKILL after this


def registry(root: str | None = None) -> Path:
    """This node's registry directory for this user (shared memory where there is one): only they can end their
    processes."""
    return Path(root or memory_dir() or tempfile.gettempdir()) / f"{REGISTRY}-{os.getuid()}"


class UntrustedRegistry(PermissionError):
    """The registry directory is not this user's alone: its records could be forged."""


def _trusted_registry(root: str | None) -> Path:
    """The registry directory, made private (0700) if new, and refused unless it is a directory (not a link) of this
    user's that nobody else may write: /dev/shm is shared by every local user, and a record there decides which
    processes get signalled."""
    path = registry(root)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UntrustedRegistry(
            f"engine registry {path} is not a directory only this user can write (mode {stat.filemode(st.st_mode)}, "
            f"uid {st.st_uid}): its records could be forged by another local user; remove it (rm -rf {path}) and "
            "start again"
        )
    return path


def _record(process: psutil.Process) -> dict[str, Any]:
    return {"pid": process.pid, "started": process.create_time()}


def _records(processes: list[psutil.Process]) -> list[dict[str, Any]]:
    """Records of the processes that still run (one may end while it is listed)."""
    records = []
    for process in processes:
        try:
            if _still_running(process):
                records.append(_record(process))
        except psutil.Error:
            pass
    return records


def _running(record: dict[str, Any]) -> psutil.Process | None:
    """The recorded process if it still runs (same pid, same start time), else None."""
    try:
        process = psutil.Process(record["pid"])
        return process if process.create_time() == record["started"] and _still_running(process) else None
    except psutil.Error:
        return None


def _still_running(process: psutil.Process) -> bool:
    """Running and the same process (psutil compares the start time); a zombie has ended and holds nothing."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if _still_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _signal(processes: list[psutil.Process], send: Any) -> None:
    for process in processes:
        try:
            send(process)  # psutil refuses to signal a process that reused the pid
        except psutil.Error:
            pass


def end_processes(records: list[dict[str, Any]], grace_s: float = GRACE_S) -> list[int]:
    """End the recorded processes that still run: SIGTERM, then SIGKILL after `grace_s`; returns their pids."""
    running = [p for p in map(_running, records) if p is not None]
    _signal(running, psutil.Process.terminate)
    _signal(_wait(running, grace_s), psutil.Process.kill)
    _wait(running, grace_s)
    return [p.pid for p in running]


def _is_record(doc: Any) -> bool:
    def process(p: Any) -> bool:
        return isinstance(p, dict) and isinstance(p.get("pid"), int) and isinstance(p.get("started"), int | float)

    return (
        isinstance(doc, dict)
        and process(doc.get("owner"))
        and isinstance(doc.get("namespace"), int)
        and isinstance(doc.get("engines"), list)
        and all(map(process, doc["engines"]))
    )


def _read(path: Path) -> dict[str, Any] | None:
    """A record, or None for what is not one: not a plain file of this user's (a link), not JSON, another shape."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if _is_record(doc) else None


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Atomically, through a temporary file of a fresh random name (created exclusively: never through a link)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc))
    os.replace(tmp, path)  # readers see the old record or the new one, never half of one


@dataclass
class EngineProcesses:
    """The processes one engine start left running, recorded under this process (their owner) in the node's registry."""

    path: Path
    processes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p["pid"] for p in self.processes]

    def reap(self, grace_s: float = GRACE_S) -> list[int]:
        """End this engine's processes (after the engine's own shutdown: whatever it left) and drop them from the
        record."""
        ended = end_processes(self.processes, grace_s)
        doc = _read(self.path)
        if doc is not None:
            mine = {p["pid"] for p in self.processes}
            doc["engines"] = [p for p in doc["engines"] if p["pid"] not in mine]
            if doc["engines"]:
                _write(self.path, doc)
            else:
                self.path.unlink(missing_ok=True)
        self.processes = []
        return ended


@contextmanager
def engine_processes(root: str | None = None) -> Iterator[EngineProcesses]:
    """Around an engine's start: orphans of dead owners on this node are ended first, then what the start leaves
    running is recorded as this process's; a start that fails leaves nothing running."""
    reap_orphans(root)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    engine = EngineProcesses(_trusted_registry(root) / f"{me.pid}.{pid_namespace()}.json")
    started = False
    try:
        yield engine
        started = True
    finally:
        engine.processes = _records([p for p in me.children(recursive=True) if p.pid not in before])
        if engine.processes:
            doc = _read(engine.path)
            if doc is None or doc["owner"] != _record(me):  # none yet, or a dead process's that had this pid
                doc = {"owner": _record(me), "namespace": pid_namespace(), "engines": []}
            doc["engines"] += engine.processes
            _write(engine.path, doc)
        if not started:
            engine.reap()


def reap_orphans(root: str | None = None, grace_s: float = GRACE_S) -> list[int]:
    """End the recorded engine processes of this pid namespace whose owner is gone on this node; returns their
    pids."""
    ended: list[int] = []
    for path in sorted(_trusted_registry(root).glob("*.json")):
        doc = _read(path)
        # Not a record (left for a person to see), another namespace's (its pids name other processes here), or live.
        if doc is None or doc["namespace"] != pid_namespace() or _running(doc["owner"]) is not None:
            continue
        ended += end_processes(doc["engines"], grace_s)
        path.unlink(missing_ok=True)
    return ended
