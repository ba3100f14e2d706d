"""Chaos: the pipeline submitted as a job to a cluster of its own while this driver injects the faults a real job
meets, then an audit that does not trust the job's own bookkeeping.

    python bench/chaos.py --seed 1 [--recipe demo] [--deadline-min 40] [key=value ...]

The cluster (tests/local_cluster.py) sees a /dev/shm of its own, a `--shm-mib` tmpfs. Each fault kind happens
once, at a time drawn from the seed on the training's own clock, its global step (so a slower machine shifts the
faults with the run): those that need the hidden-state service first, in a seeded order, while epoch 0 asks it for
states (later epochs read the state cache in hybrid mode), then the others up to 80% of the steps. A fault waits
until training has moved on from the one before (Serve replaced the replica; steps past those in flight):

- `engine`:  SIGKILL of the Serve replica's vLLM engine core (its pid from the service's /stats);
- `replica`: SIGKILL of the Serve replica (its pid from /stats);
- `shm`:     the cluster's /dev/shm filled to the last byte for `--hold-s`, then freed;
- `worker`:  SIGKILL of a Ray Train worker (its pid from the step log);
- `driver`:  SIGKILL of the job's driver process, then the same job submitted again.

A job that fails by itself is submitted again too (at most twice), and counted apart. Bounded: past the deadline
everything it started is stopped and the run is reported as failed. At the end, from outside the job:
- every sample trained once, twice or never, per epoch, from the step log (raypipe.train.steplog: the steps the
  final model holds), against the sample ids of the prepared Parquet;
- the state files left in the cluster's /dev/shm (raypipe-states-*), the engine processes left (the engine
  registry's live records, and any vLLM EngineCore process among the cluster's), Serve replicas left;
- τ from eval.json against the recorded clean demo runs (bench/results/demo.json, fresh_clone.json).
It writes bench/results/chaos.json (`python -m bench.figures` quotes it) and runs/chaos/report.json, the whole
report. tests/faults/test_chaos.py runs the same driver at CI's size. The run's own settings (`CHAOS_OVERRIDES`):
a checkpoint every 50 steps and room for 8 worker-group restarts; both are execution settings, trained the same.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # raypipe and tests.local_cluster; figures as the other benches

from raypipe.config import RaypipeConfig, load_config  # noqa: E402
from raypipe.layout import RunFolders  # noqa: E402
from raypipe.storage import Storage  # noqa: E402
from raypipe.train.steplog import once_twice_never, read_attempts, trained_counts  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.local_cluster import LocalCluster  # noqa: E402

SERVICE_FAULTS = ("engine", "replica", "shm")  # need the service in use: epoch 0 in hybrid mode
OTHER_FAULTS = ("worker", "driver")
KINDS = SERVICE_FAULTS + OTHER_FAULTS
# Execution settings only (a fingerprint ignores them): a checkpoint every 50 steps, so a fault costs a few steps, and
# room for the worker-group restarts the faults cause.
CHAOS_OVERRIDES = ("train.run.checkpoint_every=50", "train.run.max_failures=8")


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def engine_core(pids: list[int]) -> int:
    """vLLM's engine core among an engine's processes (its process title names it; the others are helpers such as
    multiprocessing's resource tracker)."""
    for pid in pids:
        try:
            if "EngineCore" in " ".join(psutil.Process(pid).cmdline()):
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no vLLM EngineCore among the engine's processes {pids}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Job:
    """The job as an operator handles it: submitted, watched, submitted again after its driver was killed or it
    failed."""

    def __init__(self, cluster: LocalCluster, entrypoint: str, script: str) -> None:
        self.cluster, self.entrypoint, self.script = cluster, entrypoint, script
        self.client = cluster.job_client()
        self.ids: list[str] = []
        self.expected_end = False  # the driver was killed on purpose
        self.failures: list[dict[str, Any]] = []  # jobs that failed by themselves
        self.logs = ""

    def submit(self) -> None:
        self.ids.append(self.client.submit_job(entrypoint=self.entrypoint, runtime_env={"working_dir": str(ROOT)}))
        log(f"job {self.ids[-1]} submitted")

    def status(self) -> str:
        """SUCCEEDED, or RUNNING while a job runs (one that ended otherwise is submitted again), or FAILED for good."""
        status = str(self.client.get_job_status(self.ids[-1]).value)
        if status in ("SUCCEEDED", "PENDING", "RUNNING"):
            return status
        self.logs = self.client.get_job_logs(self.ids[-1])
        if self.expected_end:
            self.expected_end = False
        else:
            self.failures.append({"job": self.ids[-1], "status": status, "log_tail": self.logs[-3000:]})
            log(f"job {self.ids[-1]} {status} by itself:\n{self.logs[-3000:]}")
            if len(self.failures) > 2:
                return "FAILED"
        self.submit()
        return "RUNNING"

    def driver(self) -> psutil.Process | None:
        """The running job's driver: the cluster's process running the entrypoint's script."""
        for p in self.cluster.processes():
            try:
                if self.script in " ".join(p.cmdline()) and p.name().startswith("python"):
                    return p
            except psutil.Error:
                continue
        return None


class Chaos:
    def __init__(self, cluster: LocalCluster, job: Job, cfg: RaypipeConfig, seed: int, deadline_s: float, **opts: Any):
        self.cluster, self.job, self.cfg = cluster, job, cfg
        self.rng = random.Random(seed)
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.steps = RunFolders(Storage(cfg.train.output, {}), cfg.name).steps
        self.stats_url = f"http://127.0.0.1:{cfg.serve.http_port}/hidden_states/stats"
        self.hold_s: float = opts["hold_s"]
        self.recover_s: float = opts["recover_s"]
        self.faults: list[dict[str, Any]] = []
        self.engines_seen: dict[int, float] = {}  # pid -> start time, of every engine process /stats named
        self.replicas_seen: set[int] = set()
        run = cfg.train.run
        self.moved_on = run.num_workers * (cfg.train.states.prefetch + 2)  # step lines

    def now(self) -> float:
        return round(time.monotonic() - self.start, 1)

    def step_lines(self) -> tuple[int, int, int, int]:
        """(step lines written over every attempt and rank, the latest attempt's epoch and step, the steps it plans)."""
        count, epoch, step, total = 0, 0, 0, 0
        if self.steps.fs.exists(self.steps.path()):
            for attempt in read_attempts(self.steps).values():  # in start order: the latest last
                count += sum(len(lines) for lines in attempt["ranks"].values())
                last = [lines[-1] for lines in attempt["ranks"].values() if lines]
                epoch, step = max((x["epoch"], x["step"]) for x in last) if last else (epoch, step)
                total = attempt["total_steps"] or total
        return count, epoch, step, total

    def wait(self, until: Callable[[], bool], limit_s: float) -> str:
        """Poll until `until()`, the job's end, or `limit_s`: `ok`, `done` (succeeded), `failed`, `timeout`."""
        end = min(time.monotonic() + limit_s, self.deadline)
        while time.monotonic() < end:
            status = self.job.status()
            if status == "SUCCEEDED":
                return "done"
            if status == "FAILED":
                return "failed"
            if until():
                return "ok"
            time.sleep(0.5)
        return "timeout"

    def stats(self) -> dict[str, Any] | None:
        """The service's /stats, its engine processes noted (to find them later if they outlive it); None when it does
        not answer."""
        try:
            stats = json.loads(urllib.request.urlopen(self.stats_url, timeout=5).read())
        except (OSError, ValueError):
            return None
        self.replicas_seen.add(stats["pid"])
        for pid in stats["engine_pids"]:
            try:
                self.engines_seen[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                pass
        return stats

    def inject(self, kind: str) -> dict[str, Any] | None:
        """The fault, if its target is there now; None to try again shortly."""
        if kind in ("engine", "replica"):
            stats = self.stats()
            if stats is None or not stats["engine_pids"]:
                return None
            pid = stats["pid"] if kind == "replica" else engine_core(stats["engine_pids"])
            os.kill(pid, signal.SIGKILL)
            return {"pid": pid, "replica": stats["pid"]}
        if kind == "worker":
            attempts = read_attempts(self.steps) if self.steps.fs.exists(self.steps.path()) else {}
            if not attempts:
                return None
            pids = [p for p in list(attempts.values())[-1]["pids"].values() if alive(p)]
            if not pids:
                return None
            pid = self.rng.choice(sorted(pids))
            os.kill(pid, signal.SIGKILL)
            return {"pid": pid}
        if kind == "driver":
            driver = self.job.driver()
            if driver is None:
                return None
            self.job.expected_end = True
            driver.kill()
            return {"pid": driver.pid, "job": self.job.ids[-1], "jobs_before": len(self.job.ids)}
        assert kind == "shm", kind
        return self.fill_shm()

    def fill_shm(self) -> dict[str, Any]:
        """Fill the cluster's /dev/shm to the last byte, hold it `hold_s`, free it."""
        shm = self.cluster.shm()
        filler = shm / f"chaos-fill-{os.getpid()}"
        free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
        with open(filler, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, free)
            except OSError:
                pass
            chunk = b"\0" * 65536
            try:
                while True:  # whatever fallocate left (tmpfs rounds to pages)
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
        left = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
        log(f"/dev/shm filled: {free} bytes taken, {left} left; held {self.hold_s} s")
        self.wait(lambda: False, self.hold_s)
        filler.unlink()
        return {"filled_bytes": free, "left_bytes": left, "held_s": self.hold_s}

    def schedule(self, kinds: list[str], total: int) -> list[tuple[str, int]]:
        """Each kind with the training step it strikes at, drawn from the seed: those that need the service first, in
        epoch 0 when later epochs read the state cache (hybrid), else in the first half; then the others, up to 80%
        of the run's steps."""
        service = [k for k in kinds if k in SERVICE_FAULTS]
        other = [k for k in kinds if k not in SERVICE_FAULTS]
        self.rng.shuffle(service)
        self.rng.shuffle(other)
        epochs = self.cfg.train.schedule.epochs
        first = total / epochs if self.cfg.train.states.mode == "hybrid" and epochs > 1 else total / 2
        lo, mid, hi = max(1, round(0.1 * first)), round(0.9 * first), round(0.8 * total)
        steps = sorted(self.rng.randint(lo, mid) for _ in service) + sorted(self.rng.randint(mid, hi) for _ in other)
        return list(zip(service + other, steps))

    def run(self, kinds: list[str]) -> str:
        """Inject every kind once; returns how the job ended: done, failed or timeout."""
        self.job.submit()
        ended = self.wait(lambda: self.step_lines()[0] > 0, self.deadline - time.monotonic())
        log(f"training runs at {self.now()} s" if ended == "ok" else f"job {ended} before training")
        plan = self.schedule(kinds, self.step_lines()[3]) if ended == "ok" else []
        log(f"faults at steps {plan}")
        for kind, step in plan:
            if ended != "ok":
                break
            ended = self.one_fault(kind, step)
        if ended == "ok":
            ended = self.wait(lambda: False, self.deadline - time.monotonic())
        return ended

    def one_fault(self, kind: str, at_step: int) -> str:
        """Once training reaches `at_step` (the step the latest attempt trains), the fault as soon as its target is
        there, then until training moves on again."""
        ended = self.wait(lambda: self.step_lines()[2] >= at_step, self.deadline - time.monotonic())
        if ended != "ok":
            return ended
        fault: dict[str, Any] = {}
        ended = self.wait(lambda: bool(fault.update(self.inject(kind) or {}) or fault), self.recover_s)
        if ended != "ok":
            return ended
        lines, epoch, step, _ = self.step_lines()
        fault.update(kind=kind, at_s=self.now(), planned_step=at_step, epoch=epoch, step=step)
        fault["utc"] = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.faults.append(fault)
        log(f"fault {kind}: {fault}")
        if kind == "driver":
            self.wait(lambda: len(self.job.ids) > fault["jobs_before"], 60)  # submitted again by status()
        if kind in ("engine", "replica"):  # Serve replaces the replica
            ended = self.wait(
                lambda: (self.stats() or {"pid": fault["replica"]})["pid"] != fault["replica"], self.recover_s
            )
            fault["replica_replaced_s"] = round(self.now() - fault["at_s"], 1) if ended == "ok" else None
            if ended in ("done", "failed"):
                return ended
        # Steps past those whose states were in flight when it struck: training goes on.
        ended = self.wait(lambda: self.step_lines()[0] > lines + self.moved_on, self.recover_s)
        fault["recovered_s"] = round(self.now() - fault["at_s"], 1) if ended == "ok" else None
        return ended

    def restarts_after(self) -> None:
        """Per fault, the worker-group starts (step-log attempts) between it and the next fault."""
        starts = sorted(read_attempts(self.steps)) if self.steps.fs.exists(self.steps.path()) else []
        marks = [f["utc"] for f in self.faults] + ["99999999T999999"]
        for f, until in zip(self.faults, marks[1:]):
            f["group_starts_after"] = sum(1 for a in starts if f["utc"] <= a[:15] < until)


def prepared_ids(cfg: RaypipeConfig) -> list[str]:
    import pyarrow.parquet as pq

    files = sorted(Path(cfg.data.output, "data").glob("*.parquet"))
    return [s for f in files for s in pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()]


def _pid(identity: str) -> int:
    """The pid of a process identity (pid.start.namespace) or of an engine record's name (pid.namespace)."""
    return int(identity.split(".")[0])


def leftovers(cluster: LocalCluster, chaos: Chaos) -> dict[str, list[Any]]:
    """What the job left once it ended: state files in the cluster's /dev/shm, live engine records and processes,
    Serve replicas. In the machine's own /dev/shm (no private one), only what this run's replicas and trainers own."""
    shm = cluster.shm()
    ours = cluster.shm_bytes is not None
    trainers = {pid for a in read_attempts(chaos.steps).values() for pid in a["pids"].values()}
    dirs = [d for d in shm.glob("raypipe-states-*") if ours or _pid(d.name.split("-")[2]) in chaos.replicas_seen]
    owned = [] if ours else [p for pid in trainers for p in shm.glob(f"raypipe-states-*/owner-{pid}.*")]
    files = sorted({str(p.relative_to(shm)) for d in dirs + owned for p in [d, *d.rglob("*")]})
    records = []
    for path in shm.glob("raypipe-engines-*/*.json"):
        if ours or _pid(path.stem) in chaos.replicas_seen:
            doc = json.loads(path.read_text())
            records += [e["pid"] for e in doc.get("engines", []) if alive(e["pid"])]
    cores, replicas = [], []
    for p in cluster.processes():
        try:
            text = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
        if "EngineCore" in text:
            cores.append(p.pid)
        if "ServeReplica" in text and "HiddenStateService" in text:
            replicas.append(p.pid)
    seen = [pid for pid, t in chaos.engines_seen.items() if alive(pid) and psutil.Process(pid).create_time() == t]
    return {
        "state_files": files,
        "engine_records_alive": sorted(set(records)),
        "engine_processes": sorted(set(cores) | set(seen)),
        "serve_replicas": sorted(replicas),
    }


def private_shm_refused() -> str | None:
    """Why this process cannot give a cluster a /dev/shm of its own (a tmpfs in a private mount namespace), or None."""
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as err:
        return f"unshare: {err}"
    return None if done.returncode == 0 else f"unshare/mount refused: {done.stderr.strip()[-300:]}"


def audit(cfg: RaypipeConfig, chaos: Chaos) -> dict[str, Any]:
    """The step log against the prepared samples, per epoch."""
    counts = trained_counts(chaos.steps)
    per_epoch = once_twice_never(counts, prepared_ids(cfg), cfg.train.schedule.epochs)
    attempts = read_attempts(chaos.steps)
    return {
        "per_epoch": per_epoch,
        "attempts": [{"attempt": a, "resumed": d["resumed"], "pids": d["pids"]} for a, d in attempts.items()],
    }


def clean_taus() -> dict[str, float]:
    """τ at temperature 0 of the recorded clean demo runs."""
    out = {}
    for name in ("demo", "fresh_clone"):
        path = ROOT / "bench" / "results" / f"{name}.json"
        if path.exists():
            for f in json.loads(path.read_text())["figures"]:
                if f["label"] == "τ in vLLM, T=0":
                    out[name] = f["value"]
    return out


def run_chaos(
    recipe: str,
    overrides: list[str],
    out: Path,
    seed: int,
    kinds: list[str],
    deadline_s: float,
    shm_mib: int | None = 512,
    hold_s: float = 8.0,
    recover_s: float = 600.0,
    stages: str = "pipeline",
) -> dict[str, Any]:
    """Start the cluster, submit the job, inject `kinds`, audit; stops everything it started. `stages`: `pipeline`
    (jobs/pipeline.py) or `train` (jobs/prepare_data.py, then jobs/train_drafter.py: no evaluation)."""
    shutil.rmtree(out, ignore_errors=True)  # from nothing: an earlier run's data came through another working dir
    out.mkdir(parents=True)
    port = free_port()
    run = [
        f"data.output={out}/prepared",
        f"train.output={out}/train",
        f"train.states.cache={out}/cache",
        f"serve.http_port={port}",
        *CHAOS_OVERRIDES,
        *overrides,
    ]
    cfg = load_config(recipe, run)
    refused = private_shm_refused() if shm_mib else "no --shm-mib"
    skipped = {"shm": refused} if refused and "shm" in kinds else {}
    kinds = [k for k in kinds if k not in skipped]
    scripts = ["jobs/pipeline.py"] if stages == "pipeline" else ["jobs/prepare_data.py", "jobs/train_drafter.py"]
    entrypoint = " && ".join(shlex.join([sys.executable, s, "--recipe", recipe, *run]) for s in scripts)
    cluster = LocalCluster(out / "cluster", head_cpus=4, shm_bytes=None if refused else shm_mib * 2**20)
    cluster.start()
    report: dict[str, Any] = {"recipe": recipe, "seed": seed, "overrides": run, "entrypoint": entrypoint}
    report["skipped"] = skipped  # a fault that cannot be injected here, and why
    try:
        job = Job(cluster, entrypoint, scripts[-1] if stages == "pipeline" else "jobs/")
        chaos = Chaos(cluster, job, cfg, seed, deadline_s, hold_s=hold_s, recover_s=recover_s)
        ended = chaos.run(kinds)
        chaos.restarts_after()
        report.update(
            ended=ended,
            wall_s=chaos.now(),
            faults=chaos.faults,
            jobs_submitted=len(job.ids),
            resubmitted_after_driver_kill=sum(1 for f in chaos.faults if f["kind"] == "driver"),
            failed_by_themselves=job.failures,
        )
        time.sleep(2)  # a replica being deleted as the job ends
        report["left"] = leftovers(cluster, chaos)
        report["audit"] = audit(cfg, chaos)
        eval_json = Path(cfg.train.output) / "eval" / "eval.json"
        if eval_json.exists():
            doc = json.loads(eval_json.read_text())
            report["tau"] = {str(g["temperature"]): g["tau"] for g in doc["vllm"]}
        for i, submission in enumerate(job.ids):  # every job's whole log, beside the report
            (out / f"job-{i}.log").write_text(job.client.get_job_logs(submission))
        report["job_log_tail"] = (out / f"job-{len(job.ids) - 1}.log").read_text()[-4000:]
    finally:
        cluster.stop()
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def figures_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    from figures import figure

    per_epoch = report["audit"]["per_epoch"].values()
    left = report["left"]
    out = [figure("whole chaos run", report["wall_s"], "s")]
    for f in report["faults"]:
        out.append(
            figure(
                f"fault {f['kind']} at {f['at_s']:.0f} s (epoch {f['epoch']}, step {f['step']}): worker-group starts "
                f"after it, recovered in {f['recovered_s']} s",
                f["group_starts_after"],
            )
        )
    out += [
        figure("faults injected", len(report["faults"]), at_least=len(KINDS)),
        figure("jobs submitted", report["jobs_submitted"]),
        figure("jobs failed by themselves (not the driver kill)", len(report["failed_by_themselves"]), at_most=0),
        figure("sample-epochs trained once", sum(e["once"] for e in per_epoch)),
        figure("sample-epochs trained twice or more", sum(e["twice_or_more"] for e in per_epoch), at_most=0),
        figure("sample-epochs never trained", sum(e["never"] for e in per_epoch), at_most=0),
        figure("state files left in /dev/shm", len(left["state_files"]), at_most=0),
        figure("engine processes left", len(left["engine_processes"]), at_most=0),
        figure("Serve replicas left", len(left["serve_replicas"]), at_most=0),
    ]
    if "tau" in report:
        tau = report["tau"]["0.0"]
        out.append(figure("τ in vLLM, T=0", tau))
        for name, clean in clean_taus().items():
            out.append(figure(f"τ over the clean run's ({name}: {clean})", tau / clean, "x"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--deadline-min", type=float, default=40.0)
    parser.add_argument("--shm-mib", type=int, default=512)
    parser.add_argument("--hold-s", type=float, default=8.0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    kinds = args.faults.split(",")
    assert set(kinds) <= set(KINDS), kinds
    out = ROOT / "runs" / "chaos"
    report = run_chaos(
        args.recipe,
        args.overrides,
        out / f"seed{args.seed}",
        args.seed,
        kinds,
        args.deadline_min * 60,
        args.shm_mib,
        hold_s=args.hold_s,
    )
    print(json.dumps({k: v for k, v in report.items() if k != "job_log_tail"}, indent=1))
    if report["ended"] == "done":
        from figures import record

        record("chaos", figures_of(report))
    else:
        print(report["job_log_tail"])
        sys.exit(1)


if __name__ == "__main__":
    main()
