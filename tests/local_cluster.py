"""A second Ray cluster on this machine, started with `ray start --head` as a user would, for job tests.

With `node_types` it is a fake multi-node cluster under the real autoscaler
(Ray's fake_multinode provider: each "node" is a raylet on this machine with
the node type's resources). Ray's own `AutoscalingCluster` reads a file the
wheel does not ship and runs `ray stop --force`, which would also kill the
test session's cluster; this one uses its own ports and temp dir and stops
only its own processes (and their children, such as vLLM engine cores).

With `shm_bytes` its processes see a /dev/shm of their own: a tmpfs of that
size in a private mount namespace (`unshare --mount`; needs root), which goes
away with the cluster. A chaos run fills it without touching the machine's
/dev/shm (bench/chaos.py); Ray's object store does not fit there and goes to
the temp dir, as Ray does on any node whose /dev/shm is small.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.helpers import free_ports

BIN = Path(sys.executable).parent


class LocalCluster:
    def __init__(
        self,
        root: Path,
        head_cpus: float,
        node_types: dict[str, Any] | None = None,
        idle_timeout_minutes: float = 0.5,
        auth: dict[str, str] | None = None,
        shm_bytes: int | None = None,
    ) -> None:
        self.root = root
        self.shm_bytes = shm_bytes
        self.auth = auth or {"RAY_AUTH_MODE": "disabled"}
        self.head_cpus = head_cpus
        self.node_types = node_types
        self.idle_timeout_minutes = idle_timeout_minutes
        # All of the cluster's ports in one draw, so no two of its components get the same one.
        self.gcs_port, self.dashboard_port, self.metrics_port, *self.other_ports = free_ports(8)
        # Every process of this cluster has it in its command line; short: Ray's socket paths must fit in 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        # Ray's Prometheus file-service-discovery file: every node's metrics endpoint (Ray 2.60's MetricsAgent).
        self.discovery_file = self.temp_dir / "session_latest" / "prom_metrics_service_discovery.json"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of the cluster and of job submission: one auth mode (`auth`), this venv first on PATH."""
        return {**os.environ, **self.auth, "PATH": f"{BIN}:{os.environ['PATH']}", **extra}

    def _autoscaling_config(self) -> Path:
        gcs = f"{_node_ip()}:{self.gcs_port}"
        config = {
            "cluster_name": "fake",
            "max_workers": sum(t["max_workers"] for t in self.node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": gcs,
            },
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": self.head_cpus}, "node_config": {}, "max_workers": 0},
                **self.node_types,
            },
            "head_node_type": "ray.head.default",
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }
        path = self.root / "autoscaling.json"
        path.write_text(json.dumps(config))
        return path

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        ports = self.other_ports
        cmd = [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={self.gcs_port}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={self.head_cpus}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--metrics-export-port={self.metrics_port}",
            f"--ray-client-server-port={ports[0]}",
            f"--dashboard-agent-listen-port={ports[1]}",
            f"--dashboard-agent-grpc-port={ports[2]}",
            f"--runtime-env-agent-port={ports[3]}",
            f"--node-manager-port={ports[4]}",
            "--disable-usage-stats",
        ]
        extra = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}
        if self.node_types:
            cmd.append(f"--autoscaling-config={self._autoscaling_config()}")
            extra.update(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1")
        if self.shm_bytes:
            mount = f'mount -t tmpfs -o size={self.shm_bytes},mode=1777 tmpfs /dev/shm && exec "$@"'
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
        done = subprocess.run(cmd, env=self.env(**extra), capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"ray start failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    def submit(self, entrypoint: list[str], working_dir: Path | None) -> str:
        """`ray job submit --no-wait`; returns the submission id (the CLI quotes each argument for the job's shell)."""
        upload = ["--working-dir", str(working_dir)] if working_dir else []
        out = subprocess.run(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                "--address",
                self.dashboard_url,
                *upload,
                "--no-wait",
                "--",
                *entrypoint,
            ],
            env=self.env(),
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
        [line] = [x for x in out.splitlines() if "submitted successfully" in x]
        return line.split("'")[1]

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes (their command lines name its temp dir) and all their descendants; with
        `shm_bytes`, also every process in its mount namespace (a killed parent's orphans, re-parented)."""
        mine = [p for p in psutil.process_iter(["cmdline"]) if str(self.temp_dir) in " ".join(p.info["cmdline"] or [])]
        found = {p for root in mine for p in [root, *_children(root)]}
        namespace = self._namespace()
        if namespace is not None:
            found |= {p for p in psutil.process_iter() if _namespace_of(p.pid) == namespace}
        return list(found)

    def _raylet(self) -> psutil.Process | None:
        for p in psutil.process_iter(["name", "cmdline"]):
            if p.info["name"] == "raylet" and str(self.temp_dir) in " ".join(p.info["cmdline"] or []):
                return p
        return None

    def _namespace(self) -> str | None:
        """The cluster's private mount namespace, while its raylet runs."""
        raylet = self._raylet() if self.shm_bytes else None
        return _namespace_of(raylet.pid) if raylet is not None else None

    def shm(self) -> Path:
        """The /dev/shm its processes see, from this process: with `shm_bytes`, the private one (through the raylet's
        view of the file system)."""
        if not self.shm_bytes:
            return Path("/dev/shm")
        raylet = self._raylet()
        assert raylet is not None, "the cluster's raylet is not running"
        return Path(f"/proc/{raylet.pid}/root/dev/shm")

    def job_client(self) -> Any:
        """A client of this cluster's job API. With token auth it sends the token of `RAY_AUTH_TOKEN_PATH` itself:
        this process keeps the test session's auth mode, in which Ray's client sends none."""
        from ray.job_submission import JobSubmissionClient

        headers = None
        if self.auth.get("RAY_AUTH_MODE") == "token":
            headers = {"Authorization": f"Bearer {Path(self.auth['RAY_AUTH_TOKEN_PATH']).read_text().strip()}"}
        return JobSubmissionClient(self.dashboard_url, headers=headers)

    def wait(self, submission_id: str, timeout_s: float) -> tuple[str, str]:
        """Poll the job until it ends; returns (status, logs)."""
        client = self.job_client()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = str(client.get_job_status(submission_id).value)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status, client.get_job_logs(submission_id)
            time.sleep(1)
        client.stop_job(submission_id)
        return "TIMEOUT", client.get_job_logs(submission_id)

    def node_types_alive(self) -> list[str]:
        """The node type of every alive worker node, from the autoscaler's view of the cluster."""
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(f"{_node_ip()}:{self.gcs_port}")
        names = [n.ray_node_type_name for n in status.active_nodes + status.idle_nodes]
        return sorted(n for n in names if n in (self.node_types or {}))  # the head shows under its node id

    def stop(self) -> None:
        """Kill this cluster's processes and their children; nothing else on the machine."""
        victims = self.processes()
        for p in victims:
            _signal(p, "terminate")
        _, alive = psutil.wait_procs(victims, timeout=3)  # a test cluster: nothing in it needs a longer goodbye
        for p in alive:
            _signal(p, "kill")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _signal(p: psutil.Process, how: str) -> None:
    try:
        getattr(p, how)()
    except psutil.Error:
        pass


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()
