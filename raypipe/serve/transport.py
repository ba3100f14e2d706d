"""How a request's hidden states travel from the engine to the trainer's pinned buffer, never pickled.

vLLM's connector writes each request's states to `<replica dir>/<request>.safetensors`
in shared memory (/dev/shm): `hidden_states [T, n_layers, H]` in the engine's
dtype and `token_ids [T]`, guarded by a `.lock` file until the write ends.

- Same node (the trainer and the replica share /dev/shm): the replica waits
  for the write, checks the token ids, moves the file into the trainer's
  directory `owner-<trainer pid>/` (a rename) and returns a `StateFile`: path,
  byte offset, shape and dtype, a few hundred bytes. The trainer maps the file
  and copies the states once, into its pinned buffer, then removes it.
- Other node: the replica reads the states into a NumPy array and returns it;
  Ray carries arrays through its object store out of band (no pickling), and
  the trainer copies from the read-only mapped buffer the same way.

Nothing is orphaned for long: files of a replica that died, and files handed
to a trainer that died, sit in directories named after those processes'
pids, and `reclaim_orphans` (run by every replica, periodically, and by every
trainer at start) removes the directories whose process is gone.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import stat
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PREFIX = "raypipe-states-"
OWNER = "owner-"
# safetensors dtype name: (torch dtype, NumPy dtype that carries its bits; NumPy has no bfloat16)
DTYPES = {"BF16": (torch.bfloat16, np.uint16), "F16": (torch.float16, np.float16), "F32": (torch.float32, np.float32)}


def memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def replica_dir() -> Path:
    """A fresh directory for this process's state files, named after its pid (see reclaim_orphans)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=memory_dir()))


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


def _check_ids(path: str, start: int, header: dict[str, Any], expected_ids: list[int]) -> None:
    entry = header["token_ids"]
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        ids = np.frombuffer(f.read(end - begin), dtype=np.int64 if entry["dtype"] == "I64" else np.int32)
    assert ids.tolist() == expected_ids, "hidden states of another sequence"


def hand_over(path: str, expected_ids: list[int], owner_pid: int) -> StateFile:
    """Same node: the finished file, checked and moved into the owner's directory, described."""
    _wait_for_writer(path)
    _check_written(path)
    start, header = _header(path)
    _check_complete(path, start, header)
    _check_ids(path, start, header, expected_ids)
    owner = Path(path).parent / f"{OWNER}{owner_pid}"
    owner.mkdir(exist_ok=True)
    moved = owner / Path(path).name
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def release_owner(pid: int, root: str | None = None) -> None:
    """Remove what was handed over to trainer `pid` and never read, when it ends: states whose response was lost
    (a request cancelled or resubmitted after the replica had handed them over)."""
    for owner in Path(root or memory_dir() or tempfile.gettempdir()).glob(f"{PREFIX}*/{OWNER}{pid}"):
        shutil.rmtree(owner, ignore_errors=True)


def reclaim_orphans(root: str | None = None, stale_s: float = 600.0) -> list[str]:
    """Remove state files nobody can read any more on this node; returns what was removed.

    - files of a replica whose process is gone (its engine's output, never
      handed over), and its directory once nothing in it is owned by a live trainer;
    - an owner directory whose trainer is gone (states it was handed, not read);
    - a file left in a live replica's directory for `stale_s` (a request
      abandoned between the engine and the hand-over).

    Only this user's own directories are touched, never through a symbolic link (another local user can plant
    `raypipe-states-<pid>-x` in /dev/shm), and nothing found there stops the sweep: an entry renamed by a hand-over
    while it runs, another user's directory, a plain file or a name of another shape is passed over.
    """
    base = Path(root or memory_dir() or tempfile.gettempdir())
    removed: list[str] = []
    for replica in base.glob(f"{PREFIX}*"):
        pid = replica.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and _own_directory(replica):
            try:
                removed += _reclaim_replica(replica, _alive(int(pid)), stale_s)
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


def _reclaim_replica(replica: Path, replica_alive: bool, stale_s: float) -> list[str]:
    removed = []
    for entry in list(replica.iterdir()):
        try:
            st = entry.lstat()
        except FileNotFoundError:  # handed over (renamed) since the listing
            continue
        if stat.S_ISDIR(st.st_mode):
            owner = entry.name[len(OWNER) :]
            if entry.name.startswith(OWNER) and owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(str(entry))
        elif not replica_alive or time.time() - st.st_mtime > stale_s:
            entry.unlink(missing_ok=True)  # a link itself, never what it points to
            removed.append(str(entry))
    if not replica_alive and not any(replica.iterdir()):
        replica.rmdir()
        removed.append(str(replica))
    return removed
