"""Ray Serve wiring of the hidden-state service: one replica = one engine.

The replica validates every request (a bad one is refused with a named
error and the replica stays healthy), merges concurrent extraction requests
by token budget, returns bf16 states [T, n_layers, H], and runs the parity
canary at start-up and on demand (a failed canary makes the replica refuse to
start, or report unhealthy).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch
from ray import serve
from ray.util.metrics import Counter, Gauge, Histogram
from transformers import AutoConfig

from raypipe.serve.batching import TokenBudgetBatcher
from raypipe.serve.canary import CANARY_PROMPTS, CanaryReport, compare_states
from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.validate import validate_batch


@serve.deployment
class HiddenStateService:
    def __init__(
        self,
        engine: str,
        model_dir: str,
        layer_ids: list[int],
        *,
        max_len: int = 4096,
        max_sequences: int = 64,
        max_batch_tokens: int = 16384,
        canary: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.layer_ids = tuple(layer_ids)
        if engine == "vllm":
            from raypipe.serve.vllm_engine import VllmEngine

            self.engine: Any = VllmEngine(model_dir, self.layer_ids, max_model_len=max_len, **(engine_kwargs or {}))
        elif engine == "transformers":
            self.engine = TransformersEngine(model_dir, self.layer_ids, **(engine_kwargs or {}))
        else:
            raise ValueError(f"serve.engine must be vllm or transformers, got {engine!r}")
        self.limits = {
            "vocab_size": AutoConfig.from_pretrained(model_dir).vocab_size,
            "max_len": max_len,
            "max_sequences": max_sequences,
            "max_tokens": max_batch_tokens,
        }
        self.batcher = TokenBudgetBatcher(self.engine.extract, max_batch_tokens)
        self.requests = 0
        self.last_canary: CanaryReport | None = None
        self.m_requests = Counter("raypipe_serve_requests", "Requests served, by method.", ("method",))
        self.m_tokens = Counter("raypipe_serve_tokens", "Tokens through the engine, by method.", ("method",))
        self.m_latency = Histogram("raypipe_serve_latency_s", "Request latency.", [0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120], ("method",))
        self.m_queue = Gauge("raypipe_serve_queue_depth", "Extraction requests waiting for the engine.")
        self.m_canary = Gauge("raypipe_serve_canary_ok", "1 if the last parity canary passed, else 0.")
        if canary:
            report = self._canary()
            if not report.ok:
                raise RuntimeError(report.message())

    def _canary(self) -> CanaryReport:
        prompts = [list(p) for p in CANARY_PROMPTS]
        reference = TransformersEngine(self.model_dir, self.layer_ids)
        self.last_canary = compare_states(self.engine.extract(prompts), reference.extract(prompts), self.layer_ids)
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
        replies = await asyncio.to_thread(self.engine.generate, prompts, Sampling(**(sampling or {})))
        self._served("generate", prompts, start)
        return replies

    async def canary(self) -> str:
        """Re-run the parity canary on demand."""
        return (await asyncio.to_thread(self._canary)).message()

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "requests": self.requests, "engine_calls": self.batcher.engine_calls, "canary": self.last_canary.message() if self.last_canary else None}

    def check_health(self) -> None:
        if self.last_canary is not None and not self.last_canary.ok:
            raise RuntimeError(self.last_canary.message())
