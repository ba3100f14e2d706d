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
    MismatchedStateFile,
    ShortStateFile,
    StateFile,
    as_tensor,
    copy_states,
    discard_all,
    hand_over,
    pid_namespace,
    process_identity,
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
    handed = hand_over(path, list(range(7)), process_identity())
    assert (
        isinstance(handed, StateFile)
        and Path(handed.path).parent.name == f"{OWNER}{process_identity()}"
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
    with pytest.raises(MismatchedStateFile, match=rf"{path} holds the states of another sequence.*position 2"):
        hand_over(path, [1, 2, 4], process_identity())


def test_states_of_another_sequence_are_refused_under_python_dash_o_too(tmp_path: Path) -> None:
    """The token-id check is the only check of a state file's content: `python -O`, which drops asserts, keeps it."""
    script = (
        "import sys, torch; from pathlib import Path; "
        "from raypipe.serve.transport import hand_over, process_identity, write_states; "
        "path = write_states(Path(sys.argv[1]), 'req', torch.zeros(3, 1, 4), [1, 2, 3]); "
        "hand_over(path, [1, 2, 4], process_identity())"
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-O", "-c", script, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0 and "MismatchedStateFile" in run.stderr, run.stderr[-2000:]


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
            hand_over(path, list(range(40)), process_identity())
    assert not Path(path).exists() and not (directory / f"{OWNER}{process_identity()}").exists()


@pytest.mark.parametrize("deliver", ["cross_node", "same_node"])
def test_a_state_file_never_written_is_refused_naming_dev_shm(directory: Path, deliver: str) -> None:
    """A write that fails at once (issue 40's chaos run, /dev/shm full: vLLM logs "Hidden-states write failed" and
    finishes the request) leaves no file: refused by name (the client asks again), not a bare FileNotFoundError."""
    path = str(directory / "req.safetensors")
    with pytest.raises(ShortStateFile, match=r"never written.*/dev/shm"):
        if deliver == "cross_node":
            read_array(path, [1, 2, 3])
        else:
            hand_over(path, [1, 2, 3], process_identity())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dead() -> str:
    """The identity of a process of this pid namespace that has ended."""
    return f"{_dead_pid()}.1.{pid_namespace()}"


def test_files_of_dead_replicas_and_dead_trainers_are_reclaimed(tmp_path: Path) -> None:
    dead, me = _dead(), process_identity()
    dead_replica = tmp_path / f"raypipe-states-{dead}-abc"
    live_replica = tmp_path / f"raypipe-states-{me}-def"
    for d in (
        dead_replica / f"{OWNER}{dead}",
        dead_replica / f"{OWNER}{me}",
        live_replica / f"{OWNER}{dead}",
        live_replica / f"{OWNER}{me}",
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
    assert [p.name for p in dead_replica.iterdir()] == [f"{OWNER}{me}"]
    assert sorted(p.name for p in live_replica.iterdir()) == ["fresh.safetensors", f"{OWNER}{me}"]
    for d in dead_replica.iterdir():
        shutil.rmtree(d)
    assert reclaim_orphans(str(tmp_path)) == [str(dead_replica)] and not dead_replica.exists()


def test_the_sweep_passes_over_what_it_must_not_touch_and_never_follows_a_link(tmp_path: Path) -> None:
    """Entries another local user (or a race) puts in /dev/shm neither crash the sweep nor lose data: a plain file and
    a link named like a replica's directory, an owner directory of another shape, a directory of another user (root
    here, so a chown stands in for one), and a link to a victim's folder, whose files must survive."""
    dead = _dead()
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
    replica = tmp_path / f"raypipe-states-{process_identity()}-abc"
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


OTHER_NAMESPACE = os.stat("/proc/self/ns/pid").st_ino + 1  # no test can start a process in another pid namespace


def test_a_live_replica_of_another_pid_namespace_keeps_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two containers sharing /dev/shm, each in a pid namespace of its own: a replica's pid there is nobody (or
    somebody else) here. Its directory, made as `replica_dir` makes it there (this process with its pid and namespace
    swapped), survives this namespace's sweep; only a long silence (nothing changed for `foreign_stale_s`) ends it."""
    monkeypatch.setattr("raypipe.serve.transport.memory_dir", lambda: str(tmp_path))
    dead = _dead_pid()
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: dead)
        m.setattr("raypipe.serve.transport.pid_namespace", lambda: OTHER_NAMESPACE, raising=False)
        theirs = replica_dir()
    path = write_states(theirs, "req", torch.zeros(3, 1, 4), [1, 2, 3])
    assert reclaim_orphans(str(tmp_path)) == [] and Path(path).exists(), "another namespace's live files were removed"
    silent = time.time() - 2 * 86400
    for p in (path, theirs):
        os.utime(p, (silent, silent))
    assert reclaim_orphans(str(tmp_path), foreign_stale_s=86400) == [path, str(theirs)]


def test_a_process_is_alive_with_its_pid_and_start_time_in_its_own_namespace_only(tmp_path: Path) -> None:
    """Directories named for this pid namespace are judged by pid and start time: gone when no process has the pid,
    or when another process has it now (a reused pid: another start time); a live one's is touched, so that it never
    falls silent for other namespaces. Those named for another namespace, or by a bare pid (older raypipe: any
    namespace's), are not judged by their pid, whatever it is here, only by their silence."""
    me, dead, namespace = process_identity(), _dead(), pid_namespace()
    pid, started, _ = me.split(".")
    reused = f"{pid}.{int(started) - 1}.{namespace}"
    replica = tmp_path / f"raypipe-states-{me}-abc"
    foreign = [f"{pid}.1.{OTHER_NAMESPACE}", f"{_dead_pid()}.1.{OTHER_NAMESPACE}", str(_dead_pid())]
    for name in [me, dead, reused, *foreign]:
        (replica / f"{OWNER}{name}").mkdir(parents=True)
    (tmp_path / f"raypipe-states-{reused}-def").mkdir()
    (tmp_path / f"raypipe-states-{reused}-def" / "x.safetensors").write_bytes(b"states")
    silent = time.time() - 2 * 86400
    os.utime(replica, (silent, silent))
    removed = reclaim_orphans(str(tmp_path))
    reused_replica = tmp_path / f"raypipe-states-{reused}-def"
    assert sorted(removed) == sorted(
        [
            str(replica / f"{OWNER}{dead}"),
            str(replica / f"{OWNER}{reused}"),
            str(reused_replica / "x.safetensors"),
            str(reused_replica),
        ]
    )
    assert time.time() - replica.stat().st_mtime < 60, "a live replica's directory was not touched"
    for name in [me, *foreign]:
        os.utime(replica / f"{OWNER}{name}", (silent, silent))
    assert sorted(reclaim_orphans(str(tmp_path), foreign_stale_s=86400)) == sorted(
        str(replica / f"{OWNER}{name}") for name in foreign
    )
    assert [p.name for p in replica.iterdir()] == [f"{OWNER}{me}"]


def test_states_are_handed_over_only_to_a_process_identity(directory: Path) -> None:
    """The owner names a directory: anything but an identity (a path) is refused before the file is touched."""
    path = write_states(directory, "req", torch.zeros(3, 1, 4), [1, 2, 3])
    with pytest.raises(ValueError, match="not a process identity"):
        hand_over(path, [1, 2, 3], "../../elsewhere")
    assert Path(path).exists()


def test_every_file_of_a_request_is_discarded_though_one_fails(directory: Path) -> None:
    """Engine outputs and handed-over states alike; the one that cannot be removed is reported, not raised."""
    paths = [write_states(directory, f"req{i}", torch.zeros(2, 1, 4), [1, 2]) for i in range(3)]
    (directory / "stuck.safetensors").mkdir()
    stuck = str(directory / "stuck.safetensors")
    [failure] = discard_all([paths[0], stuck, paths[1], StateFile(paths[2], 0, (2, 1, 4), "F32")])
    assert failure.startswith(f"{stuck}: ") and not any(Path(p).exists() for p in paths)
