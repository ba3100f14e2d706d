"""Ray Serve wiring of the hidden-state service: one replica = one engine.

The replica validates every request (a bad one is refused with a named
error and the replica stays healthy), merges concurrent extraction requests
by token budget, returns bf16 states [T, n_layers, H], and runs the parity
canary at start-up and on demand (with `canary: refuse` a mismatch stops the
replica from serving). An HTTP ingress (loopback unless configured) answers
/health, /stats and /canary for operators; the trainer uses the handle.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from ray import serve
from ray.util.metrics import Counter, Gauge, Histogram

from raypipe.config import ServeConfig
from raypipe.serve.batching import TokenBudgetBatcher
from raypipe.serve.canary import CanaryReport, canary_prompts, compare_states
from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.validate import validate_batch
from raypipe.target import BUILTIN_TARGETS, resolve_model, resolve_target

APP_NAME = "raypipe_hidden_states"
api = FastAPI(title="raypipe hidden-state service")


@serve.deployment
@serve.ingress(api)
class HiddenStateService:
    def __init__(self, cfg: ServeConfig) -> None:
        target = resolve_target(cfg)
        self.target = target
        self.layer_ids = target.layer_ids
        if cfg.engine == "vllm":
            from raypipe.serve.vllm_engine import VllmEngine

            self.engine: Any = VllmEngine(target, cfg)
        else:
            self.engine = TransformersEngine(target.path, self.layer_ids, dtype=cfg.dtype)
        self.identity = {"engine": cfg.engine, "model": cfg.model, "layer_ids": list(self.layer_ids), "dtype": cfg.dtype}
        self.limits = {
            "vocab_size": target.shape.vocab_size,
            "max_len": cfg.max_model_len,
            "max_sequences": cfg.max_sequences,
            "max_tokens": cfg.max_batch_tokens,
        }
        self._engine_lock = threading.Lock()  # engines are not thread-safe: one call at a time
        self.batcher = TokenBudgetBatcher(lambda seqs: self._call(self.engine.extract, seqs), cfg.max_batch_tokens)
        self.requests = 0
        self.last_canary: CanaryReport | None = None
        self.m_requests = Counter("raypipe_serve_requests", "Requests served, by method.", ("method",))
        self.m_tokens = Counter("raypipe_serve_tokens", "Tokens through the engine, by method.", ("method",))
        self.m_latency = Histogram("raypipe_serve_latency_s", "Request latency.", [0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120], ("method",))
        self.m_queue = Gauge("raypipe_serve_queue_depth", "Extraction requests waiting for the engine.")
        self.m_canary = Gauge("raypipe_serve_canary_ok", "1 if the last parity canary passed, else 0.")
        self.canary_mode = cfg.canary
        if cfg.canary != "off":
            report = self._canary()
            if not report.ok and cfg.canary == "refuse":
                raise RuntimeError(report.message())

    def _call(self, fn: Any, *args: Any) -> Any:
        with self._engine_lock:
            return fn(*args)

    def _canary(self) -> CanaryReport:
        reference = TransformersEngine(self.target.path, self.layer_ids)
        prompts = canary_prompts(reference.vocab_size)
        self.last_canary = compare_states(self._call(self.engine.extract, prompts), reference.extract(prompts), self.layer_ids)
        self.m_canary.set(int(self.last_canary.ok))
        return self.last_canary

    def _served(self, method: str, batch: list[list[int]], start: float) -> None:
        tags = {"method": method}
        self.m_requests.inc(1, tags)
        self.m_tokens.inc(sum(map(len, batch)), tags)
        self.m_latency.observe(time.perf_counter() - start, tags)

    async def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """bf16 hidden states [T, len(layer_ids), H] per sequence."""
        validate_batch(batch, **self.limits)
        start = time.perf_counter()
        self.requests += 1
        self.m_queue.set(self.batcher.queued())
        states = await self.batcher.submit(batch)
        self._served("extract", batch, start)
        return [s.to(torch.bfloat16) for s in states]

    async def generate(self, prompts: list[list[int]], sampling: dict[str, Any] | None = None) -> list[list[int]]:
        validate_batch(prompts, **self.limits)
        start = time.perf_counter()
        self.requests += 1
        replies = await asyncio.to_thread(self._call, self.engine.generate, prompts, Sampling(**(sampling or {})))
        self._served("generate", prompts, start)
        return replies

    @api.post("/canary")
    async def canary(self) -> str:
        """Re-run the parity canary on demand."""
        return (await asyncio.to_thread(self._canary)).message()

    @api.get("/stats")
    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "layer_ids": list(self.layer_ids),
            "requests": self.requests,
            "engine_calls": self.batcher.engine_calls,
            "canary": self.last_canary.message() if self.last_canary else None,
        }

    @api.get("/health")
    async def health(self) -> str:
        try:
            await self.check_health()
        except Exception as err:  # noqa: BLE001 - any failure means unhealthy, with its reason
            raise HTTPException(503, f"{type(err).__name__}: {err}") from None
        return "ok"

    def __del__(self) -> None:
        """Graceful shutdown: Serve drains the replica, then the engine and its state files go."""
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    async def describe(self) -> dict[str, Any]:
        """What this service serves: a client attaching to a running service checks it is the one it needs."""
        return self.identity

    async def check_health(self) -> None:
        """Unhealthy when the canary failed (refuse mode) or the engine cannot extract one token."""
        if self.canary_mode == "refuse" and self.last_canary is not None and not self.last_canary.ok:
            raise RuntimeError(self.last_canary.message())
        await self.batcher.submit([[0]])  # a real one-token extraction


def replica_resources(cfg: ServeConfig) -> dict[str, Any]:
    """Ray resources of one replica: CPUs, GPUs, and `serve.resource` (one unit per GPU, or one on CPU-only nodes)."""
    options: dict[str, Any] = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
    if cfg.resource:
        options["resources"] = {cfg.resource: cfg.num_gpus or 1}
    return options


def build_app(cfg: ServeConfig) -> Any:
    """The Serve application for a config: replicas, resources and limits from `serve.*`."""
    return HiddenStateService.options(
        ray_actor_options=replica_resources(cfg),
        max_ongoing_requests=cfg.max_ongoing_requests,
        logging_config={"enable_access_log": False},  # one line per extraction drowns the job's log
        autoscaling_config={
            "min_replicas": cfg.min_replicas,
            "max_replicas": cfg.max_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests,
            "upscale_delay_s": cfg.upscale_delay_s,
            "downscale_delay_s": cfg.downscale_delay_s,
        },
    ).bind(cfg)


def run_service(cfg: ServeConfig, blocking: bool = True) -> Any:
    """Start Serve's HTTP proxy on the configured host and deploy the service; returns the handle."""
    serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
    return serve.run(build_app(cfg), name=APP_NAME, route_prefix="/hidden_states", blocking=blocking)


def attach_service(cfg: ServeConfig) -> Any | None:
    """The running hidden-state service's handle if it serves what `cfg` needs, None if none runs; another target is an error."""
    try:
        status = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - Serve is not running on this cluster yet
        status = None
    if status is None or status.status != "RUNNING":
        return None
    handle = serve.get_app_handle(APP_NAME)
    running = handle.describe.remote().result()
    wanted = {"engine": cfg.engine, "model": cfg.model, "dtype": cfg.dtype, "layer_ids": cfg.layer_ids or running["layer_ids"]}
    if running != wanted:
        raise ValueError(
            f"the running hidden-state service serves {running}, this config needs {wanted}; "
            f"stop it (`serve shutdown -y`) or run with the serve.* settings it was started with"
        )
    return handle


def ensure_service(cfg: ServeConfig) -> Any:
    """Attach to the running hidden-state service, or deploy it; returns the handle once it serves."""
    handle = attach_service(cfg)
    if handle is not None:
        return handle
    if cfg.model in BUILTIN_TARGETS:
        resolve_model(cfg.model)  # build it here with every core, not in the replica's one thread (it is cached on disk)
    return run_service(cfg, blocking=False)
