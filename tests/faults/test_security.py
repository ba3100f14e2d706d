"""Security: the cluster's token auth and loopback dashboard on a real Ray head, the canary's one bf16 reference with
serialized runs, and no advice anywhere to end processes by a name pattern."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from raypipe.serve.canary import Canary
from raypipe.serve.hf_engine import TransformersEngine
from tests.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
LAYERS = (1, 2, 4)


def _status(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        return urllib.request.urlopen(request, timeout=30).status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.integration
def test_the_clusters_ray_start_settings_refuse_jobs_without_the_token(tmp_path: Path) -> None:
    """cluster.yaml's head auth settings on a real head started with `ray start` (its own ports, beside the session's
    cluster): the job API answers only with the token, the dashboard listens on loopback only, and `ray job submit`
    as the README writes it runs a job that reaches the cluster."""
    head = next(
        c for c in yaml.safe_load((ROOT / "cluster.yaml").read_text())["head_start_ray_commands"] if "ray start" in c
    )
    auth = dict(re.findall(r"\b(RAY_AUTH_[A-Z_]+)=(\S+)", head))
    assert re.findall(r"--dashboard-host[= ](\S+)", head) == ["127.0.0.1"]  # what LocalCluster starts with too
    token = os.urandom(32).hex()  # what `ray get-auth-token --generate` writes
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    cluster = LocalCluster(
        tmp_path / "cluster", head_cpus=1, auth={**auth, "RAY_AUTH_TOKEN_PATH": str(token_file)}
    )  # the file mounted at the YAML's path
    try:
        cluster.start()
        jobs = f"{cluster.dashboard_url}/api/jobs/"
        deadline = time.monotonic() + 120
        while _status(jobs, token) != 200 and time.monotonic() < deadline:
            time.sleep(1)
        assert _status(jobs, token) == 200
        assert _status(jobs, None) == 401
        assert _status(jobs, "0" * 64) == 403
        listening = {
            c.laddr.ip
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == cluster.dashboard_port
        }
        assert listening == {"127.0.0.1"}
        # the job's driver reaches the GCS with the token too
        driver = "import ray; ray.init(); print('driver', ray.is_initialized())"
        submit = [
            str(Path(sys.executable).parent / "ray"),
            "job",
            "submit",
            "--address",
            cluster.dashboard_url,
            "--",
            sys.executable,
            "-c",
            driver,
        ]
        client = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
        deadline = time.monotonic() + 300
        done = subprocess.run(submit, env=client, capture_output=True, text=True, timeout=300)
        while (
            "No available agent to submit job" in done.stderr and time.monotonic() < deadline
        ):  # the head's job agent starts after the dashboard
            time.sleep(5)
            done = subprocess.run(submit, env=client, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "driver True" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
        refused = subprocess.run(
            submit, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0 and "Missing authentication token" in refused.stderr, refused.stderr[
            -2000:
        ]  # the dashboard's 401
    finally:
        cluster.stop()


def test_the_canary_reference_is_built_once_in_bf16_and_runs_are_serialized(tiny_target: str) -> None:
    served_by = TransformersEngine(tiny_target, LAYERS)  # a real fp32 engine in the serving engine's place
    active, most = 0, 0

    async def served(prompts: list[list[int]]) -> list[torch.Tensor]:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await asyncio.sleep(0.2)  # another run, were it let in, would start here
        states = await asyncio.to_thread(served_by.extract, prompts)
        active -= 1
        return states

    async def four_runs_at_once(canary: Canary) -> list:
        return await asyncio.gather(*(canary.run(served) for _ in range(4)))

    canary = Canary(tiny_target, LAYERS)
    assert canary.builds == 0  # lazily: nothing loaded before the first run
    reports = asyncio.run(four_runs_at_once(canary))
    assert all(r.ok for r in reports), [r.message() for r in reports]
    assert canary.builds == 1 and canary.runs == 4 and canary.reference_dtype == "bfloat16"
    assert most == 1, "canary runs overlapped"
    assert max(reports[0].errors) > 1e-4  # the bf16 reference differs from the fp32 engine, within the tolerance


def test_a_bf16_reference_still_names_a_wrong_layer(tiny_target: str) -> None:
    shifted = TransformersEngine(tiny_target, (1, 3, 4))  # layer 2 read one layer too late

    async def served(prompts: list[list[int]]) -> list[torch.Tensor]:
        return shifted.extract(prompts)

    report = asyncio.run(Canary(tiny_target, LAYERS).run(served))
    assert (
        not report.ok
        and "layer 2" in report.message()
        and "layer 1:" not in report.message()
        and "layer 4" not in report.message()
    )


PATTERN_KILLS = re.compile(r"\b(pkill|killall|pgrep)\b|kill\s+-9\s+\$\(|xargs\s+(-\S+\s+)*kill\b")


def test_no_file_suggests_ending_processes_by_a_name_pattern() -> None:
    """On a shared node, a name pattern ends other users' and other jobs' processes too: raypipe ends its own by pid."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if name == this or not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [
            f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if PATTERN_KILLS.search(line)
        ]
    assert not found, "\n".join(found)
