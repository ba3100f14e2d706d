"""States handed over as files on one node, as arrays across nodes; nothing orphaned outlives its process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from raypipe.serve.transport import (
    OWNER,
    ShortStateFile,
    StateFile,
    as_tensor,
    copy_states,
    hand_over,
    read_array,
    reclaim_orphans,
    replica_dir,
    states_dtype,
    write_states,
)


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("raypipe.serve.transport.memory_dir", lambda: str(tmp_path))
    return replica_dir()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_same_node_hand_over_copies_once_into_the_buffer_and_removes_the_file(
    directory: Path, dtype: torch.dtype
) -> None:
    states = torch.randn(7, 3, 16).to(dtype)
    path = write_states(directory, "req", states, list(range(7)))
    handed = hand_over(path, list(range(7)), owner_pid=os.getpid())
    assert (
        isinstance(handed, StateFile)
        and Path(handed.path).parent.name == f"{OWNER}{os.getpid()}"
        and not Path(path).exists()
    )
    assert handed.shape == (7, 3, 16) and states_dtype(handed) == dtype
    buffer = torch.zeros(10, 3, 16, dtype=dtype)
    copy_states(handed, buffer[2:9])
    assert torch.equal(buffer[2:9], states) and not buffer[:2].any() and not Path(handed.path).exists()


def test_the_cross_node_array_carries_bf16_bits(directory: Path) -> None:
    states = torch.randn(5, 2, 8).to(torch.bfloat16)
    array = read_array(write_states(directory, "req", states, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
    assert array.dtype == np.uint16 and array.shape == (5, 2, 8) and not list(directory.iterdir())
    assert torch.equal(as_tensor(array), states)
    array.setflags(write=False)  # as the object store hands it over
    out = torch.empty(5, 2, 8, dtype=torch.bfloat16)
    copy_states(array, out)
    assert torch.equal(out, states)


def test_states_of_another_sequence_are_refused(directory: Path) -> None:
    path = write_states(directory, "req", torch.zeros(3, 1, 4), [1, 2, 3])
    with pytest.raises(AssertionError, match="another sequence"):
        hand_over(path, [1, 2, 4], owner_pid=os.getpid())


@pytest.mark.timeout(60)  # before the check, the cross-node read spun forever on the end of the file
@pytest.mark.parametrize("deliver", ["cross_node", "same_node"])
def test_a_state_file_cut_short_is_refused_at_once_naming_dev_shm(directory: Path, deliver: str) -> None:
    """A write cut short (ENOSPC on /dev/shm, an engine killed mid-write) leaves a file whose token ids still check
    out: it is refused by name and removed, never read past its end or handed to a trainer."""
    path = write_states(directory, "req", torch.randn(40, 3, 64), list(range(40)))
    size = os.path.getsize(path)
    os.truncate(path, size - 1000)
    with pytest.raises(ShortStateFile, match=rf"is {size - 1000} bytes where its header promises {size}.*/dev/shm"):
        if deliver == "cross_node":
            read_array(path, list(range(40)))
        else:
            hand_over(path, list(range(40)), owner_pid=os.getpid())
    assert not Path(path).exists() and not (directory / f"{OWNER}{os.getpid()}").exists()


@pytest.mark.parametrize("deliver", ["cross_node", "same_node"])
def test_a_state_file_never_written_is_refused_naming_dev_shm(directory: Path, deliver: str) -> None:
    """A write that fails at once (issue 40's chaos run, /dev/shm full: vLLM logs "Hidden-states write failed" and
    finishes the request) leaves no file: refused by name (the client asks again), not a bare FileNotFoundError."""
    path = str(directory / "req.safetensors")
    with pytest.raises(ShortStateFile, match=r"never written.*/dev/shm"):
        if deliver == "cross_node":
            read_array(path, [1, 2, 3])
        else:
            hand_over(path, [1, 2, 3], owner_pid=os.getpid())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_files_of_dead_replicas_and_dead_trainers_are_reclaimed(tmp_path: Path) -> None:
    dead = _dead_pid()
    dead_replica = tmp_path / f"raypipe-states-{dead}-abc"
    live_replica = tmp_path / f"raypipe-states-{os.getpid()}-def"
    for d in (
        dead_replica / f"{OWNER}{dead}",
        dead_replica / f"{OWNER}{os.getpid()}",
        live_replica / f"{OWNER}{dead}",
        live_replica / f"{OWNER}{os.getpid()}",
    ):
        d.mkdir(parents=True)
        (d / "x.safetensors").write_bytes(b"states")
    (dead_replica / "unread.safetensors").write_bytes(b"engine output of the dead replica")
    (live_replica / "fresh.safetensors").write_bytes(b"engine output, not handed over yet")
    stale = live_replica / "stale.safetensors"
    stale.write_bytes(b"abandoned")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    removed = reclaim_orphans(str(tmp_path), stale_s=600)
    gone = [
        dead_replica / f"{OWNER}{dead}",
        dead_replica / "unread.safetensors",
        live_replica / f"{OWNER}{dead}",
        stale,
    ]
    assert sorted(removed) == sorted(map(str, gone))
    # A live trainer keeps what it was handed, even from a replica that died since.
    assert [p.name for p in dead_replica.iterdir()] == [f"{OWNER}{os.getpid()}"]
    assert sorted(p.name for p in live_replica.iterdir()) == ["fresh.safetensors", f"{OWNER}{os.getpid()}"]
    for d in dead_replica.iterdir():
        shutil.rmtree(d)
    assert reclaim_orphans(str(tmp_path)) == [str(dead_replica)] and not dead_replica.exists()


def test_the_sweep_passes_over_what_it_must_not_touch_and_never_follows_a_link(tmp_path: Path) -> None:
    """Entries another local user (or a race) puts in /dev/shm neither crash the sweep nor lose data: a plain file and
    a link named like a replica's directory, an owner directory of another shape, a directory of another user (root
    here, so a chown stands in for one), and a link to a victim's folder, whose files must survive."""
    dead = _dead_pid()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"another user's data")
    (tmp_path / f"raypipe-states-{dead}-link").symlink_to(victim)
    (tmp_path / f"raypipe-states-{dead}-file").write_bytes(b"not a directory")
    odd = tmp_path / f"raypipe-states-{dead}-odd"
    (odd / "owner-x").mkdir(parents=True)
    (odd / "link.safetensors").symlink_to(victim / "precious")
    others = tmp_path / f"raypipe-states-{dead}-others"
    (others / "x.safetensors").parent.mkdir()
    (others / "x.safetensors").write_bytes(b"states")
    os.chown(others, 4242, 4242)
    removed = reclaim_orphans(str(tmp_path), stale_s=600)
    assert sorted(removed) == [str(odd / "link.safetensors")]  # the link removed, not what it points to
    assert (victim / "precious").read_bytes() == b"another user's data" and (others / "x.safetensors").exists()
    assert (odd / "owner-x").is_dir()


def test_an_entry_handed_over_during_the_sweep_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep lists a live replica's directory, then looks at each entry: one renamed into a trainer's directory in
    between (a hand-over) is skipped, the rest swept."""
    replica = tmp_path / f"raypipe-states-{os.getpid()}-abc"
    replica.mkdir()
    for name in ("handed.safetensors", "stale.safetensors"):
        (replica / name).write_bytes(b"states")
        os.utime(replica / name, (time.time() - 3600, time.time() - 3600))
    listed = Path.iterdir

    def iterdir_then_hand_over(self: Path):
        entries = list(listed(self))
        if self == replica and (replica / "handed.safetensors").exists():
            (replica / "handed.safetensors").unlink()  # renamed away after the listing
        return iter(entries)

    monkeypatch.setattr(Path, "iterdir", iterdir_then_hand_over)
    assert reclaim_orphans(str(tmp_path), stale_s=600) == [str(replica / "stale.safetensors")]
