"""The vLLM engine processes raypipe starts are ended by their pids: on a clean shutdown, and after their owner is
killed hard.

The first tests drive raypipe.serve.reaper with real processes (an owner that
starts children, killed with SIGKILL); the last one runs the hidden-state
service with the real vLLM CPU engine in Serve, kills its replica hard, and
finds the orphaned engine core ended when the next replica starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from raypipe.serve.reaper import UntrustedRegistry, engine_processes, reap_orphans, registry
from raypipe.serve.transport import pid_namespace
from raypipe.serve.vllm_args import ENGINE_ENV

OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from raypipe.serve.reaper import engine_processes
    with engine_processes(sys.argv[1]) as engine:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an 'engine' of this owner
    print(" ".join(map(str, engine.pids)), flush=True)
    time.sleep(600)
    """
)


def _gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _record(root: Path | None, owner: int) -> Path:
    """The registry's record of owner pid `owner` of this pid namespace."""
    return registry(str(root) if root else None) / f"{owner}.{pid_namespace()}.json"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_owner_killed_hard_leaves_its_engine_running_until_the_next_start_reaps_it(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    [child] = map(int, owner.stdout.readline().split())
    assert json.loads(_record(tmp_path, owner.pid).read_text())["engines"][0]["pid"] == child
    assert reap_orphans(str(tmp_path)) == []  # its owner lives: not an orphan
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    time.sleep(1)
    assert _alive(child), "the child died with its owner: nothing here would show the reaping"
    with engine_processes(str(tmp_path)) as started:  # the next engine start on the node reaps the orphan first
        pass
    assert _gone(child) and started.pids == []
    assert not list(registry(str(tmp_path)).glob("*.json"))


def test_a_reused_pid_is_never_taken_for_an_engine(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (another start time) ends nothing."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = psutil.Process(bystander.pid).create_time()
        dead_owner = {"pid": 2**22 + 1, "started": 1.0}  # beyond pid_max: no such process
        engine = {"pid": bystander.pid, "started": started - 5.0}
        doc = {"owner": dead_owner, "namespace": pid_namespace(), "engines": [engine]}
        registry(str(tmp_path)).mkdir(parents=True)
        (registry(str(tmp_path)) / "1.json").write_text(json.dumps(doc))
        assert reap_orphans(str(tmp_path)) == []
        assert bystander.poll() is None
        assert not (registry(str(tmp_path)) / "1.json").exists()  # the dead owner's record is gone all the same
    finally:
        bystander.kill()
        bystander.wait()


def test_a_clean_close_ends_its_processes_and_its_record(tmp_path: Path) -> None:
    with engine_processes(str(tmp_path)) as engine:
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
            ]
        )
    assert engine.pids == [child.pid]
    time.sleep(0.5)  # the child ignores SIGTERM from here on: the reaper must escalate to SIGKILL
    assert engine.reap(grace_s=1.0) == [child.pid]
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not _record(tmp_path, os.getpid()).exists()


def test_a_failed_start_leaves_nothing_running(tmp_path: Path) -> None:
    children = []
    with pytest.raises(RuntimeError, match="engine failed"):
        with engine_processes(str(tmp_path)):
            children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise RuntimeError("engine failed")
    assert children[0].wait(timeout=30) == -signal.SIGTERM
    assert not list(registry(str(tmp_path)).glob("*.json"))


VLLM_OWNER = textwrap.dedent(
    """
    import sys, time
    import raypipe.serve.reaper
    raypipe.serve.reaper.memory_dir = lambda: sys.argv[2]  # a registry of this test's own, as in the tests above
    from raypipe.serve.transport import replica_dir
    from raypipe.serve.vllm_engine import VllmEngine
    from raypipe.target import resolve_target
    from tests.helpers import serve_config
    cfg = serve_config(sys.argv[1], layer_ids=[1, 4])
    engine = VllmEngine(resolve_target(cfg), cfg, replica_dir())
    print("engine pids", *engine.engine_pids, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.integration
def test_a_real_vllm_engine_outlives_its_owner_killed_outside_ray_until_the_next_engine_start(
    tiny_target: str, tmp_path: Path
) -> None:
    """What a replica leaves when nothing in Ray ends its process group (`ray stop --force`, a raylet that died):
    the real vLLM CPU engine core keeps running after its owner's SIGKILL, and the next engine start on the node ends
    it. The registry is the test's own: the suite's other stream starts engines and runs replicas (which sweep the
    node's registry every minute) on this machine meanwhile, and one of them would reap the orphan first."""
    root = Path(__file__).resolve().parents[2]
    owner = subprocess.Popen(
        [sys.executable, "-c", VLLM_OWNER, tiny_target, str(tmp_path)],
        cwd=root,
        env={**os.environ, **ENGINE_ENV},  # as a replica's process has it
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = ""
        while not line.startswith("engine pids"):
            line = owner.stdout.readline()
            assert line, "the owner exited before its engine started"
        engines = [int(p) for p in line.split()[2:]]
        cores = [p for p in engines if "EngineCore" in psutil.Process(p).name()]
        assert cores, [psutil.Process(p).name() for p in engines]
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    time.sleep(5)
    assert all(_alive(p) for p in cores), "the engine core ended with its owner: nothing here would show the reaping"
    assert _record(tmp_path, owner.pid).exists()
    with engine_processes(str(tmp_path)):  # the next engine start on this node
        pass
    assert all(_gone(p) for p in engines)
    assert not _record(tmp_path, owner.pid).exists()


def _replaced(handle: object, pid: int, timeout_s: float = 600) -> dict:
    """The stats of the replica Serve started in place of `pid`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stats = handle.stats.remote().result(timeout_s=60)
            if stats["pid"] != pid:
                return stats
        except Exception:  # noqa: BLE001 - the replica is down or starting; Serve retries
            pass
        time.sleep(1)
    raise AssertionError(f"Serve did not replace replica {pid}")


@pytest.mark.integration
def test_a_killed_replicas_record_is_reaped_by_the_next_replica_and_a_deleted_service_leaves_no_engine(
    ray_cluster, tiny_target
):
    from ray import serve

    from raypipe.serve.deployment import HiddenStateService, engine_process_options
    from tests.helpers import serve_config

    cfg = serve_config(tiny_target, layer_ids=[1, 2, 4], canary="off")
    app = HiddenStateService.options(ray_actor_options=engine_process_options(cfg)).bind(cfg)
    handle = serve.run(app, name="reaping_test", route_prefix=None)
    try:
        stats = handle.stats.remote().result()
        replica, engines = stats["pid"], stats["engine_pids"]
        assert engines and set(engines) <= {p.pid for p in psutil.Process(replica).children(recursive=True)}
        assert json.loads(_record(None, replica).read_text())["engines"] == [
            {"pid": p, "started": psutil.Process(p).create_time()} for p in engines
        ]
        # The canary on demand, twice at once: one reference, in bf16, built on the first call; both runs pass.
        first, second = handle.canary.remote(), handle.canary.remote()
        assert first.result().startswith("canary ok") and second.result().startswith("canary ok")
        assert handle.stats.remote().result()["canary_reference"] == {"builds": 1, "runs": 2, "dtype": "bfloat16"}

        # Ray 2.60 ends a killed worker's process group itself once its raylet notices (about 2 s here); the next
        # replica's start finds the dead owner's record and ends whatever of it is left, then drops the record.
        os.kill(replica, signal.SIGKILL)
        stats = _replaced(handle, replica)
        assert all(_gone(p) for p in engines), "the killed replica's engine core outlived the next replica's start"
        assert not _record(None, replica).exists()
        replacement, engines = stats["pid"], stats["engine_pids"]
        assert engines and all(_alive(p) for p in engines)
    finally:
        serve.delete("reaping_test")
    assert all(_gone(p) for p in engines), "serve.delete left an engine process running"
    assert not _record(None, replacement).exists()


def _start_and_close(root: Path) -> list[int]:
    """An engine start here (a child recorded in the registry), then its close; the child's pid."""
    with engine_processes(str(root)) as engine:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = engine.pids
    engine.reap(grace_s=5)
    return pids


@pytest.mark.parametrize("planted", ["open_to_all", "another_user", "link"])
def test_a_registry_others_can_write_is_refused_by_name(tmp_path: Path, planted: str) -> None:
    """/dev/shm is shared by every local user: a registry another user made (or can write) could hold forged records
    that decide which processes get signalled, so an engine start refuses it, naming it and the fix."""
    path = registry(str(tmp_path))
    if planted == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir(mode=0o700)
        if planted == "open_to_all":
            path.chmod(0o777)
        else:
            os.chown(path, 4242, 4242)  # root here: a chown stands in for another user's directory
    with pytest.raises(UntrustedRegistry, match=rf"{path} is not a directory only this user can write.*rm -rf {path}"):
        _start_and_close(tmp_path)
    with pytest.raises(UntrustedRegistry):
        reap_orphans(str(tmp_path))


def test_what_is_not_a_record_is_passed_over_and_a_planted_link_is_never_written_through(tmp_path: Path) -> None:
    """An empty `{}` (before: KeyError 'owner' at every engine start on the node), a record of another shape and a link
    named like a record are passed over; a link planted at the name the temporary record file used to take is never
    written through (the victim's file is intact)."""
    path = registry(str(tmp_path))
    path.mkdir(mode=0o700)
    (path / "1.json").write_text("{}")
    (path / "2.json").write_text(json.dumps({"owner": {"pid": "x"}, "engines": []}))
    forged = tmp_path / "forged.json"
    bystander = {"pid": os.getpid(), "started": 0}
    forged.write_text(json.dumps({"owner": {"pid": 1, "started": 0.0}, "engines": [bystander]}))
    (path / "3.json").symlink_to(forged)
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's file")
    (path / f".{os.getpid()}.json.{os.getpid()}.tmp").symlink_to(victim)
    assert reap_orphans(str(path.parent)) == []
    [child] = _start_and_close(tmp_path)
    assert _gone(child) and victim.read_text() == "the victim's file"
    assert sorted(p.name for p in path.glob("*.json")) == ["1.json", "2.json", "3.json"]  # left for a person to see


def test_a_record_of_another_pid_namespace_never_ends_a_process_here(tmp_path: Path) -> None:
    """Containers that share /dev/shm with pid namespaces of their own share the registry: a record written in one
    names its pids, and its owner's pid is nobody here while its engine's may be a process here (here: a bystander,
    start time and all). Such a record ends nothing, and is left for its own namespace to judge."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        engine = {"pid": bystander.pid, "started": psutil.Process(bystander.pid).create_time()}
        other_namespace = pid_namespace() + 1
        doc = {"owner": {"pid": 2**22 + 1, "started": 1.0}, "namespace": other_namespace, "engines": [engine]}
        registry(str(tmp_path)).mkdir(parents=True)
        record = registry(str(tmp_path)) / f"{2**22 + 1}.{other_namespace}.json"
        record.write_text(json.dumps(doc))
        assert reap_orphans(str(tmp_path), grace_s=1.0) == []
        assert bystander.poll() is None and record.exists()
    finally:
        bystander.kill()
        bystander.wait()
