"""How a request's hidden states travel from the engine to the trainer's pinned buffer, never pickled.

vLLM's connector writes each request's states to `<replica dir>/<request>.safetensors`
in shared memory (/dev/shm): `hidden_states [T, n_layers, H]` in the engine's
dtype and `token_ids [T]`, guarded by a `.lock` file until the write ends.

- Same node (the trainer and the replica share /dev/shm): the replica waits
  for the write, checks the token ids, moves the file into the trainer's
  directory `owner-<trainer identity>/` (a rename) and returns a
  `StateFile`: path, byte offset, shape and dtype, a few hundred bytes. The
  trainer maps the file and copies the states once, into its pinned buffer,
  then removes it.
- Other node: the replica reads the states into a NumPy array and returns it;
  Ray carries arrays through its object store out of band (no pickling), and
  the trainer copies from the read-only mapped buffer the same way.

Nothing is orphaned for long: files of a replica that died, and files handed
to a trainer that died, sit in directories named after those processes
(`process_identity`: pid, start time, pid namespace), and `reclaim_orphans`
(run by every replica, periodically, and by every trainer at start) removes
the directories whose process is gone. A pid means something only in its own
pid namespace, and containers that share /dev/shm may each have their own:
a directory named for another namespace is never judged by its pid, only
removed after a long silence (live processes' directories are touched at
every sweep of their own namespace); the start time tells a pid reused by
another process from the one that made the directory.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raypipe.console import logger

PREFIX = "raypipe-states-"
OWNER = "owner-"
STALE_S = 600.0  # a file this old in a live replica's directory was abandoned between the engine and the hand-over
IDENTITY = re.compile(r"(\d+)\.(\d+)\.(\d+)")  # process_identity; older raypipe reads a bare pid: passes these over
FOREIGN_STALE_S = 86400.0  # another pid namespace's directory this long unchanged is gone (see reclaim_orphans)
# safetensors dtype name: (torch dtype, NumPy dtype that carries its bits; NumPy has no bfloat16)
DTYPES = {"BF16": (torch.bfloat16, np.uint16), "F16": (torch.float16, np.float16), "F32": (torch.float32, np.float32)}


def memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def pid_namespace() -> int:
    """This process's pid namespace (its inode): where its pid, and the pids it sees, mean something."""
    return os.stat("/proc/self/ns/pid").st_ino


def _started(pid: int | str) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat's 22nd field), None if there is none; the
    name before it, in parentheses, may hold spaces and parentheses itself."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line.rsplit(")", 1)[1].split()[19])


def process_identity() -> str:
    """`<pid>.<start time>.<pid namespace>` of this process: what names its directories (see reclaim_orphans)."""
    return f"{os.getpid()}.{_started('self')}.{pid_namespace()}"


def replica_dir() -> Path:
    """A fresh directory for this process's state files, named after its identity (see reclaim_orphans)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{process_identity()}-", dir=memory_dir()))


@dataclass(frozen=True)
class StateFile:
    """States of one sequence in a file on this node: `shape` values of `dtype` at byte `offset`."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: BF16, F16, F32

    def copy_into(self, out: torch.Tensor, remove: bool = True) -> None:
        """Copy the states into `out` (a slice of the pinned buffer) in one pass, then remove the file (unless a later
        copy needs it)."""
        count = int(np.prod(self.shape))
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
            with warnings.catch_warnings():  # read-only memory: only ever copied from
                warnings.simplefilter("ignore", UserWarning)
                view = torch.frombuffer(mapped, dtype=DTYPES[self.dtype][0], count=count, offset=self.offset)
            out.copy_(view.view(self.shape))
            del view  # the mapping closes only when no tensor views it
        if remove:
            os.unlink(self.path)


def _header(path: str) -> tuple[int, dict[str, Any]]:
    """(byte offset of the data section, the safetensors header)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


def _wait_for_writer(path: str) -> None:
    """The connector holds an exclusive lock on `<path>.lock` while it writes; wait for it, then drop the lock file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
        os.unlink(lock)


class ShortStateFile(OSError):
    """A state file shorter than its header says, or missing: the engine's write was cut short or failed. Transient
    as its usual cause is (a full /dev/shm), the client asks again (raypipe.serve.client)."""


def _check_written(path: str) -> None:
    """The engine wrote the file at all: a write that fails at once leaves none (seen with /dev/shm full: vLLM logs
    "Hidden-states write failed ... SafetensorError" and the request finishes all the same)."""
    if not os.path.exists(path):
        raise ShortStateFile(
            f"state file {path} was never written: the engine's write failed (vLLM logs 'Hidden-states write "
            f"failed'); the usual cause is a full {Path(path).parent.parent} (check `df -h /dev/shm`: Ray's object "
            "store shares it)"
        )


def _check_complete(path: str, start: int, header: dict[str, Any]) -> None:
    """The file holds every byte its header promises; else it is removed and refused, naming the usual cause. vLLM
    only logs "Hidden-states write failed" when its write fails (a full /dev/shm, an engine killed mid-write), and the
    token ids, written first, still check out."""
    promised = start + max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__")
    size = os.path.getsize(path)
    if size < promised:
        Path(path).unlink(missing_ok=True)
        raise ShortStateFile(
            f"state file {path} is {size} bytes where its header promises {promised}: the engine's write was cut short "
            f"(vLLM logs 'Hidden-states write failed'); the usual cause is a full {Path(path).parent.parent} "
            "(check `df -h /dev/shm`: Ray's object store shares it), else an engine killed mid-write"
        )


class MismatchedStateFile(OSError):
    """A state file whose token ids are not the request's: the states of another sequence."""


def _check_ids(path: str, start: int, header: dict[str, Any], expected_ids: list[int]) -> None:
    """The file's token ids are the request's (a real check, kept under `python -O`: the only one of the content)."""
    entry = header["token_ids"]
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        ids = np.frombuffer(f.read(end - begin), dtype=np.int64 if entry["dtype"] == "I64" else np.int32).tolist()
    if ids != expected_ids:
        differ = next(
            (i for i, (a, b) in enumerate(zip(ids, expected_ids)) if a != b), min(len(ids), len(expected_ids))
        )
        raise MismatchedStateFile(
            f"state file {path} holds the states of another sequence: {len(ids)} token ids where the request has "
            f"{len(expected_ids)}, the first difference at position {differ}. The engine wrote other tokens than it "
            "was asked for (a vLLM whose hidden-states connector names its files otherwise, or that changed the "
            "prompt); check that vLLM is the version raypipe pins (pyproject.toml)"
        )


def hand_over(path: str, expected_ids: list[int], owner: str) -> StateFile:
    """Same node: the finished file, checked and moved into the directory of `owner` (its `process_identity`),
    described."""
    if not IDENTITY.fullmatch(owner):  # it names a directory: never a path of the caller's choosing
        raise ValueError(f"owner {owner!r} is not a process identity (pid.start.namespace): pass process_identity()")
    _wait_for_writer(path)
    _check_written(path)
    start, header = _header(path)
    _check_complete(path, start, header)
    _check_ids(path, start, header, expected_ids)
    owner_dir = Path(path).parent / f"{OWNER}{owner}"
    owner_dir.mkdir(exist_ok=True)
    moved = owner_dir / Path(path).name
    os.rename(path, moved)
    entry = header["hidden_states"]
    return StateFile(str(moved), start + entry["data_offsets"][0], tuple(entry["shape"]), entry["dtype"])


def read_array(path: str, expected_ids: list[int]) -> np.ndarray:
    """Other node: the finished file's states as an array (bf16 as its bits, uint16), the file removed."""
    _wait_for_writer(path)
    _check_written(path)
    start, header = _header(path)
    _check_complete(path, start, header)
    _check_ids(path, start, header, expected_ids)
    entry = header["hidden_states"]
    array = np.empty(entry["shape"], dtype=DTYPES[entry["dtype"]][1])
    target = memoryview(array).cast("B")
    with open(path, "rb", buffering=0) as f:  # read straight into the array Ray will ship out of band
        f.seek(start + entry["data_offsets"][0])
        done = 0
        while done < len(target):
            read = f.readinto(target[done:])
            if not read:  # cut after the check: never spin on the end of the file
                _check_complete(path, start, header)
                raise ShortStateFile(f"state file {path} ended {len(target) - done} bytes early while read")
            done += read
    os.unlink(path)
    return array


def discard(path: str) -> None:
    """Remove a file nobody will read (a reply's states, a cancelled request's), once its writer is done."""
    _wait_for_writer(path)
    Path(path).unlink(missing_ok=True)


def discard_if_written(path: str) -> bool:
    """Remove the file if it is written, without waiting for a writer; True when it was. An aborted request's file is
    written on a later engine step if it was scheduled, never if not: its caller polls instead of blocking."""
    lock = path + ".lock"
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.unlink(lock)
    except FileNotFoundError:
        pass
    except BlockingIOError:
        return False  # being written
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def discard_all(files: Iterable[str | StateFile]) -> list[str]:
    """Remove the files of a request nobody will read (its engine's output, or states already handed over), every
    one of them whatever the others do; returns the failures, logged: one file that cannot be removed must not leave
    the rest behind (the sweep of reclaim_orphans finds it later)."""
    failures = []
    for file in files:
        try:
            if isinstance(file, StateFile):
                Path(file.path).unlink(missing_ok=True)
            else:
                discard(file)
        except OSError as err:
            failures.append(f"{file.path if isinstance(file, StateFile) else file}: {err}")
    if failures:
        logger("serve").warning(f"{len(failures)} state files not removed: " + "; ".join(failures))
    return failures


def write_states(directory: Path, name: str, states: torch.Tensor, token_ids: list[int]) -> str:
    """The connector's file format, for engines that compute states in this process (the transformers reference)."""
    from safetensors.torch import save_file

    path = str(directory / f"{name}.safetensors")
    save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(token_ids, dtype=torch.int64)}, path)
    return path


def copy_states(source: StateFile | np.ndarray | torch.Tensor, out: torch.Tensor) -> None:
    """Copy one sequence's states, however they arrived, into `out`."""
    if isinstance(source, StateFile):
        source.copy_into(out)
    elif isinstance(source, np.ndarray):
        tensor = torch.from_numpy(source)  # read-only object-store memory: copied from, never written
        out.copy_(tensor.view(torch.bfloat16) if source.dtype == np.uint16 else tensor)
    else:
        out.copy_(source)


def source_kind(source: StateFile | np.ndarray | torch.Tensor) -> str:
    """file: handed over on this node; array: from another node through the object store; cache: a stored tensor."""
    return "file" if isinstance(source, StateFile) else "array" if isinstance(source, np.ndarray) else "cache"


def states_dtype(source: StateFile | np.ndarray | torch.Tensor) -> torch.dtype:
    if isinstance(source, StateFile):
        return DTYPES[source.dtype][0]
    if isinstance(source, np.ndarray):
        return torch.bfloat16 if source.dtype == np.uint16 else torch.from_numpy(source[:0]).dtype
    return source.dtype


def as_tensor(source: StateFile | np.ndarray | torch.Tensor, keep_file: bool = False) -> torch.Tensor:
    """A sequence's states as a tensor of their own (tests, the canary, the cache); training copies straight into its
    buffer instead."""
    if isinstance(source, torch.Tensor):
        return source
    if isinstance(source, np.ndarray):
        tensor = torch.from_numpy(source.copy())
        return tensor.view(torch.bfloat16) if source.dtype == np.uint16 else tensor
    out = torch.empty(source.shape, dtype=DTYPES[source.dtype][0])
    source.copy_into(out, remove=not keep_file)
    return out


def release_owner(owner: str, root: str | None = None) -> None:
    """Remove what was handed over to the trainer of identity `owner` and never read, when it ends: states whose
    response was lost (a request cancelled or resubmitted after the replica had handed them over)."""
    for owner_dir in Path(root or memory_dir() or tempfile.gettempdir()).glob(f"{PREFIX}*/{OWNER}{owner}"):
        shutil.rmtree(owner_dir, ignore_errors=True)


def release_request(owner: str, tag: str, root: str | None = None) -> int:
    """Remove the files of request `tag` handed over to the trainer of identity `owner` (`<tag>-<i>.safetensors`): a
    request its caller cancelled, whose replica had handed them over anyway. Returns how many were removed."""
    removed = 0
    base = Path(root or memory_dir() or tempfile.gettempdir())
    for path in base.glob(f"{PREFIX}*/{OWNER}{owner}/{tag}-*.safetensors"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def reclaim_orphans(
    root: str | None = None, stale_s: float = STALE_S, foreign_stale_s: float = FOREIGN_STALE_S
) -> list[str]:
    """Remove state files nobody can read any more on this node; returns what was removed.

    - files of a replica whose process is gone (its engine's output, never
      handed over), and its directory once nothing in it is owned by a live trainer;
    - an owner directory whose trainer is gone (states it was handed, not read);
    - a file left in a live replica's directory for `stale_s` (a request
      abandoned between the engine and the hand-over).

    A process is gone when no process of this pid namespace has its pid and start time. A directory named for
    another namespace (another container sharing /dev/shm), or of an older shape (a bare pid, from before identities:
    its namespace is unknown), is judged by its silence instead: gone once it has not changed for `foreign_stale_s`.
    So every sweep touches the directories whose process it found alive: a live one never falls silent.

    Only this user's own directories are touched, never through a symbolic link (another local user can plant
    `raypipe-states-<identity>-x` in /dev/shm), and nothing found there stops the sweep: an entry renamed by a
    hand-over while it runs, another user's directory, a plain file or a name of another shape is passed over.
    """
    base = Path(root or memory_dir() or tempfile.gettempdir())
    removed: list[str] = []
    for replica in base.glob(f"{PREFIX}*"):
        if _own_directory(replica):
            try:
                removed += _reclaim_replica(replica, foreign_stale_s, stale_s)
            except OSError:  # gone or changed while swept: the next sweep sees it as it is then
                continue
    return removed


def _own_directory(path: Path) -> bool:
    """A directory of this user's, not a link to one."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _gone(directory: Path, identity: str, foreign_stale_s: float) -> bool:
    """Whether the process `identity` names is gone (see reclaim_orphans); a live one's directory is touched."""
    match = IDENTITY.fullmatch(identity)
    if match is None or int(match[3]) != pid_namespace():
        return time.time() - directory.lstat().st_mtime > foreign_stale_s
    if _started(match[1]) != int(match[2]):  # no such pid here, or another process has it now
        return True
    os.utime(directory)
    return False


def _reclaim_replica(replica: Path, foreign_stale_s: float, stale_s: float) -> list[str]:
    replica_gone = _gone(replica, replica.name[len(PREFIX) :].rsplit("-", 1)[0], foreign_stale_s)
    removed = []
    for entry in list(replica.iterdir()):
        try:
            st = entry.lstat()
            if stat.S_ISDIR(st.st_mode):
                if entry.name.startswith(OWNER) and _gone(entry, entry.name[len(OWNER) :], foreign_stale_s):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(str(entry))
            elif replica_gone or time.time() - st.st_mtime > stale_s:
                entry.unlink(missing_ok=True)  # a link itself, never what it points to
                removed.append(str(entry))
        except FileNotFoundError:  # handed over (renamed) or released since the listing
            continue
    if replica_gone and not any(replica.iterdir()):
        replica.rmdir()
        removed.append(str(replica))
    return removed
