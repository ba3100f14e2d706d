"""Ray Serve wiring of the hidden-state service: one replica = one engine.

The replica validates every request (a bad one is refused with a named
error and the replica stays healthy), passes each sequence to the engine as
a request of its own (vLLM batches them continuously), and returns each
sequence's states without pickling them (raypipe.serve.transport): a file
descriptor when the caller runs on this node, an array through the object
store otherwise. It runs the parity canary at start-up and on demand (with
`canary: refuse` a mismatch stops the replica from serving; its reference is
computed once per replica, in bf16, one decoder layer at a time), reclaims the
state files of dead replicas and trainers on its node, and ends the vLLM engine
processes that dead owners left on it (raypipe.serve.reaper), its own when it
shuts down. An HTTP ingress (loopback unless configured) answers /health,
/stats and /canary for operators; the trainer uses the handle.

Deploying fails fast: the replicas' engines are checked against the machine's
memory first (raypipe.node_memory), each replica checks that its node's
/dev/shm holds the state files' peak beside the object store (raypipe.shm)
before it starts its engine, and the first replica that cannot start
fails the deployment, which raises that replica's own error (vLLM's, with the
setting that fixes it: raypipe.serve.vllm_engine) instead of Serve retrying it.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
from fastapi import FastAPI, HTTPException
from ray import serve
from ray.util.metrics import Gauge, Histogram

from raypipe.config import RaypipeConfig, ServeConfig
from raypipe.console import logger
from raypipe.counters import counter
from raypipe.node_memory import check_engine_memory
from raypipe.serve.canary import Canary, CanaryReport
from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.reaper import reap_orphans
from raypipe.serve.transport import (
    STALE_S,
    StateFile,
    as_tensor,
    discard_all,
    discard_if_written,
    hand_over,
    read_array,
    reclaim_orphans,
    replica_dir,
    write_states,
)
from raypipe.serve.validate import validate_batch
from raypipe.serve.vllm_args import ENGINE_ENV
from raypipe.shm import check_node_shm
from raypipe.sizing import state_files_peak
from raypipe.target import resolve_target

APP_NAME = "raypipe_hidden_states"
METHODS = ("extract", "generate")  # the service's request kinds: the `method` tag of its counters
RECLAIM_EVERY_S = 60.0
EXCEPTION_LINE = re.compile(r"(?:\w+\.)*\w+(?:Error|Exception): ")
api = FastAPI(title="raypipe hidden-state service")


class ReferenceEngine:
    """The transformers engine behind the same asynchronous interface: one call at a time, states written as vLLM's
    connector writes them."""

    def __init__(self, engine: TransformersEngine, directory: Path) -> None:
        self.engine = engine
        self.directory = directory
        self._lock = threading.Lock()  # transformers models are not thread-safe

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def extract(self, ids: list[int], name: str | None = None) -> str:
        [states] = await asyncio.to_thread(self._locked, self.engine.extract, [ids])
        return write_states(self.directory, name or uuid.uuid4().hex, states, ids)

    async def generate(self, ids: list[int], sampling: Sampling, name: str | None = None) -> list[int]:
        [reply] = await asyncio.to_thread(self._locked, self.engine.generate, [ids], sampling)
        return reply

    @property
    def engine_pids(self) -> list[int]:
        return []  # it runs in the replica's own process

    @property
    def aborted(self) -> int:
        return 0  # a call in a thread cannot be stopped: it runs to its end, and a cancelled one writes no file

    async def check_health(self) -> None:
        return None

    def close(self) -> None:
        return None


def _deliver(paths: list[str], batch: list[list[int]], owner: str | None) -> list[StateFile | np.ndarray]:
    """Each sequence's states as the caller takes them: handed over to `owner` on this node, else read into arrays.
    On any failure every file of the request is removed, those already handed over included. (Defined above the
    deployment: Serve pickles the class, with the globals its methods use, when the class is defined.)"""
    out: list[StateFile | np.ndarray] = []
    try:
        for path, ids in zip(paths, batch):
            out.append(hand_over(path, ids, owner) if owner is not None else read_array(path, ids))
    except BaseException:
        discard_all([*paths, *(state for state in out if isinstance(state, StateFile))])
        raise
    return out


@serve.deployment
@serve.ingress(api)
class HiddenStateService:
    async def __init__(self, cfg: ServeConfig, state_files_peak: int = 0) -> None:
        check_node_shm(state_files_peak)
        reclaim_orphans()
        target = resolve_target(cfg)
        self.target = target
        self.layer_ids = target.layer_ids
        self.directory = replica_dir()
        self.node_id = ray.get_runtime_context().get_node_id()
        if cfg.engine == "vllm":
            from raypipe.serve.vllm_engine import VllmEngine

            self.engine: Any = VllmEngine(target, cfg, self.directory)
        else:
            self.engine = ReferenceEngine(
                TransformersEngine(target.path, self.layer_ids, dtype=cfg.dtype), self.directory
            )
        self.identity = {
            "engine": cfg.engine,
            "model": cfg.model,
            "layer_ids": list(self.layer_ids),
            "dtype": cfg.dtype,
            "max_model_len": cfg.max_model_len,
        }
        self.limits = {
            "vocab_size": target.shape.vocab_size,
            "max_len": cfg.max_model_len,
            "max_sequences": cfg.max_sequences,
            "max_tokens": cfg.max_batch_tokens,
        }
        self.requests = 0
        self.in_flight = 0  # sequences inside the engine now
        self.max_in_flight = 0
        self._background: set[asyncio.Future[Any]] = set()  # cancelled hand-overs, finishing (see extract)
        self._abandoned: dict[str, float] = {}  # aborted requests' files, removed once written (see _abandon)
        self.last_canary: CanaryReport | None = None
        self.canary_check = Canary(target.path, self.layer_ids, max_len=cfg.max_model_len - 1)
        methods = [{"method": m} for m in METHODS]  # at 0 from the start (raypipe.counters)
        self.m_requests = counter("raypipe_serve_requests", "Requests served, by method.", ("method",), methods)
        self.m_tokens = counter("raypipe_serve_tokens", "Tokens through the engine, by method.", ("method",), methods)
        self.m_latency = Histogram(
            "raypipe_serve_latency_s", "Request latency.", [0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120], ("method",)
        )
        self.m_queue = Gauge("raypipe_serve_queue_depth", "Sequences inside the engine (running or waiting).")
        self.m_canary = Gauge("raypipe_serve_canary_ok", "1 if the last parity canary passed, else 0.")
        self.canary_mode = cfg.canary
        if cfg.canary != "off":
            report = await self._canary()
            if not report.ok and cfg.canary == "refuse":
                self.engine.close()  # its processes end now, not when the next replica on this node reaps them
                raise RuntimeError(report.message())
        self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim_periodically())

    async def _reclaim_periodically(self) -> None:
        """Every RECLAIM_EVERY_S for the replica's life: a sweep that fails is logged, and the next one runs."""
        while True:
            await asyncio.sleep(RECLAIM_EVERY_S)
            for sweep in (self._sweep_abandoned, reclaim_orphans, reap_orphans):
                try:
                    await asyncio.to_thread(sweep)
                except Exception:  # the loop outlives any one sweep
                    logger("serve").exception(f"{sweep.__name__} failed; it runs again")

    def _later(self, work: Any) -> None:
        """Run `work` in the background, held until it ends (the loop keeps only weak references to tasks)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _left(self, _: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        self.m_queue.set(self.in_flight)

    async def _paths(self, batch: list[list[int]], tag: str) -> list[str]:
        """One engine request per sequence, all in flight together, the i-th writing `<tag>-<i>.safetensors`. A
        cancelled call cancels its engine requests, which vLLM aborts (raypipe.serve.vllm_engine): those not yet
        computed cost nothing more, and the files of those computed are removed once written, by their known names."""
        names = [f"{tag}-{i}" for i in range(len(batch))]
        tasks = [asyncio.ensure_future(self.engine.extract(ids, name)) for ids, name in zip(batch, names)]
        self.in_flight += len(tasks)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.m_queue.set(self.in_flight)
        for task in tasks:
            task.add_done_callback(self._left)
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            self._abandon([str(self.directory / f"{name}.safetensors") for name in names])
            raise
        if any(isinstance(r, BaseException) for r in results):
            await asyncio.to_thread(discard_all, [p for p in results if isinstance(p, str)])
            raise next(r for r in results if isinstance(r, BaseException))
        return list(results)

    def _abandon(self, paths: list[str]) -> None:
        """Files an aborted request may still get (the engine writes what it had computed): removed by the periodic
        sweep once written, forgotten after the stale age (a request aborted before it ran writes none)."""
        for path in paths:
            self._abandoned[path] = time.monotonic() + STALE_S
        self._later(self._sweep_soon())

    async def _sweep_soon(self, every_s: float = 0.5, times: int = 20) -> None:
        """An aborted request that was scheduled has its file written at the engine's next step: look for a while,
        so /dev/shm holds it seconds rather than until the periodic sweep."""
        for _ in range(times):
            await asyncio.sleep(every_s)
            await asyncio.to_thread(self._sweep_abandoned)

    def _sweep_abandoned(self) -> None:
        for path, until in list(self._abandoned.items()):
            if discard_if_written(path) or time.monotonic() > until:
                del self._abandoned[path]

    async def _discard_when_done(self, delivery: asyncio.Future[Any]) -> None:
        """Remove the files a cancelled call's hand-over delivered, once it ends."""
        try:
            states = await delivery
        except Exception:  # noqa: BLE001 - a failed hand-over removed its files itself
            return
        await asyncio.to_thread(discard_all, [s for s in states if isinstance(s, StateFile)])

    async def _canary_states(self, prompts: list[list[int]]) -> list[Any]:
        """The engine's states for the canary prompts, through the same path as every request."""
        paths = await self._paths(prompts, uuid.uuid4().hex)
        return await asyncio.to_thread(lambda: [as_tensor(read_array(p, ids)) for p, ids in zip(paths, prompts)])

    async def _canary(self) -> CanaryReport:
        self.last_canary = await self.canary_check.run(self._canary_states)
        self.m_canary.set(int(self.last_canary.ok))
        return self.last_canary

    def _served(self, method: str, batch: list[list[int]], start: float) -> None:
        tags = {"method": method}
        self.m_requests.inc(1, tags)
        self.m_tokens.inc(sum(map(len, batch)), tags)
        self.m_latency.observe(time.perf_counter() - start, tags)

    async def extract(
        self,
        batch: list[list[int]],
        node_id: str | None = None,
        owner: str | None = None,
        tag: str | None = None,
    ) -> list[StateFile | np.ndarray]:
        """States [T, len(layer_ids), H] per sequence, in the engine's dtype: a `StateFile` handed to `owner` (the
        caller's `process_identity`) when it runs on this node (`node_id`), else a NumPy array (bf16 as uint16) through
        the object store. The i-th sequence's file is `<tag>-<i>.safetensors`: a caller that cancels the request can
        remove what was handed over to it anyway (raypipe.serve.transport.release_request)."""
        validate_batch(batch, **self.limits)
        start = time.perf_counter()
        self.requests += 1
        paths = await self._paths(batch, tag or uuid.uuid4().hex)
        owner = owner if node_id == self.node_id else None
        delivery = asyncio.ensure_future(asyncio.to_thread(_deliver, paths, batch, owner))
        try:
            states = await asyncio.shield(delivery)
        except asyncio.CancelledError:
            self._later(self._discard_when_done(delivery))  # files handed over to a caller that will never read them
            raise
        self._served("extract", batch, start)
        return states

    async def generate(self, prompts: list[list[int]], sampling: dict[str, Any] | None = None) -> list[list[int]]:
        validate_batch(prompts, **self.limits)
        start = time.perf_counter()
        self.requests += 1
        tag = uuid.uuid4().hex
        names = [f"{tag}-{i}" for i in range(len(prompts))]
        tasks = [
            asyncio.ensure_future(self.engine.generate(ids, Sampling(**(sampling or {})), name))
            for ids, name in zip(prompts, names)
        ]
        try:
            replies = await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()  # aborted in the engine, as in _paths
            self._abandon([str(self.directory / f"{name}.safetensors") for name in names])
            raise
        self._served("generate", prompts, start)
        return list(replies)

    @api.post("/canary")
    async def canary(self) -> str:
        """Re-run the parity canary on demand."""
        return (await self._canary()).message()

    @api.get("/stats")
    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": self.node_id,
            "directory": str(self.directory),
            "layer_ids": list(self.layer_ids),
            "requests": self.requests,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "aborted": self.engine.aborted,  # engine requests cancelled before their end, aborted in the engine
            "abandoned": len(self._abandoned),
            "canary": self.last_canary.message() if self.last_canary else None,
            "canary_reference": {
                "builds": self.canary_check.builds,
                "runs": self.canary_check.runs,
                "dtype": self.canary_check.reference_dtype,
            },
            "engine_pids": self.engine.engine_pids,  # the vLLM processes this replica started (raypipe.serve.reaper)
        }

    @api.get("/health")
    async def health(self) -> str:
        try:
            await self.check_health()
        except Exception as err:  # noqa: BLE001 - any failure means unhealthy, with its reason
            raise HTTPException(503, f"{type(err).__name__}: {err}") from None
        return "ok"

    def __del__(self) -> None:
        """Graceful shutdown: Serve drains the replica, then the engine goes (its processes ended by pid), and its
        directory unless a trainer still owns files in it."""
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()
        directory = getattr(self, "directory", None)
        if directory is not None and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()

    async def describe(self) -> dict[str, Any]:
        """What this service serves: a client attaching to a running service checks it is the one it needs."""
        return self.identity

    async def check_health(self) -> None:
        """Unhealthy when the canary failed (refuse mode) or the engine is dead; never waits behind requests."""
        if self.canary_mode == "refuse" and self.last_canary is not None and not self.last_canary.ok:
            raise RuntimeError(self.last_canary.message())
        await self.engine.check_health()


def engine_process_options(cfg: ServeConfig) -> dict[str, Any]:
    """Ray options of a process that runs an engine (a replica, a reply writer, an evaluation task): CPUs, GPUs,
    `serve.resource` (one unit per GPU, or one on CPU-only nodes), and ENGINE_ENV."""
    options: dict[str, Any] = {
        "num_cpus": cfg.num_cpus,
        "num_gpus": cfg.num_gpus,
        "runtime_env": {"env_vars": ENGINE_ENV},
    }
    if cfg.resource:
        options["resources"] = {cfg.resource: cfg.num_gpus or 1}
    return options


def build_app(cfg: ServeConfig, state_files_peak: int = 0) -> Any:
    """The Serve application for a config: replicas, resources and limits from `serve.*`; each replica checks that
    `state_files_peak` bytes of state files fit in its node's /dev/shm (raypipe.sizing.state_files_peak)."""
    return HiddenStateService.options(
        ray_actor_options=engine_process_options(cfg),
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_constructor_retry_count=1,  # a replica that cannot start fails the deployment (Serve retries 3 times)
        logging_config={"enable_access_log": False},  # one line per extraction drowns the job's log
        autoscaling_config={
            "min_replicas": cfg.min_replicas,
            "max_replicas": cfg.max_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests,
            "upscale_delay_s": cfg.upscale_delay_s,
            "downscale_delay_s": cfg.downscale_delay_s,
        },
    ).bind(cfg, state_files_peak)


def replica_error(app: Any) -> str:
    """The replica's exception in a failed application's status (its deployment's message ends with the replica's
    traceback, whose last exception line is it), else the application's message."""
    lines = "\n".join(d.message for d in app.deployments.values()).splitlines()
    found = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
    return found[-1] if found else app.message


def deploy(cfg: ServeConfig, blocking: bool = False, state_files_peak: int = 0) -> Any:
    """Deploy the service on the running Serve; returns the handle once it serves (then blocks if `blocking`). When a
    replica fails to start, the application is deleted and the replica's error raised."""
    try:
        return serve.run(
            build_app(cfg, state_files_peak), name=APP_NAME, route_prefix="/hidden_states", blocking=blocking
        )
    except RuntimeError:
        app = serve.status().applications.get(APP_NAME)
        if app is None or app.status != "DEPLOY_FAILED":
            raise
    serve.delete(APP_NAME)
    raise RuntimeError(f"the hidden-state service did not start: {replica_error(app)}")


def run_service(cfg: ServeConfig, blocking: bool = True, state_files_peak: int = 0) -> Any:
    """Start Serve's HTTP proxy on the configured host, check that the replicas' engines fit this machine's memory,
    and deploy the service; returns the handle."""
    serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
    check_engine_memory(cfg, cfg.max_replicas)
    return deploy(cfg, blocking, state_files_peak)


def attach_service(cfg: ServeConfig) -> Any | None:
    """The running hidden-state service's handle if it serves what `cfg` needs, None if none runs; another target is
    an error."""
    try:
        status = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - Serve is not running on this cluster yet
        status = None
    if status is None or status.status != "RUNNING":
        return None
    handle = serve.get_app_handle(APP_NAME)
    running = handle.describe.remote().result()
    wanted = {
        "engine": cfg.engine,
        "model": cfg.model,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,  # the longest row it takes (raypipe.serve.validate)
        "layer_ids": cfg.layer_ids or running["layer_ids"],
    }
    if running != wanted:
        raise ValueError(
            f"the running hidden-state service serves {running}, this config needs {wanted}; "
            f"stop it (`serve shutdown -y`) or run with the serve.* settings it was started with"
        )
    return handle


def ensure_service(cfg: RaypipeConfig) -> Any:
    """Attach to the running hidden-state service, or deploy it for the run's trainers; returns the handle once it
    serves."""
    handle = attach_service(cfg.serve)
    if handle is not None:
        return handle
    return run_service(cfg.serve, blocking=False, state_files_peak=run_state_files_peak(cfg))


def run_state_files_peak(cfg: RaypipeConfig) -> int:
    """The state files' peak in /dev/shm for the run's trainers (raypipe.sizing.state_files_peak); a builtin target is
    built here with every core, not in the replica's one thread."""
    target = resolve_target(cfg.serve)
    return state_files_peak(cfg, target.shape.state_bytes_per_token(len(target.layer_ids)))
