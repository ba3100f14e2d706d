"""Latency as users feel it: vLLM's OpenAI-compatible server, with and without the drafter, at each concurrency.

The server is vLLM's own (`vllm.entrypoints.openai.api_server`), started as a
subprocess with the evaluation's engine options. Each level sends the same
held-out prompts (token ids, `/v1/completions`, streamed, temperature 0) from
`concurrency` clients at once, and measures per request:
- TTFT: from sending the request to its first streamed token;
- TPOT: from the first token to the last, over the tokens after the first;
and per level the generated tokens per second of wall time and τ, from the
server's spec-decode counters (`/metrics`) read before and after the level.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from raypipe.console import logger
from raypipe.serve.vllm_args import API_SERVER, server_flags

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


def server_command(engine: dict[str, Any], speculative: dict[str, Any] | None, port: int) -> list[str]:
    """The `vllm.LLM` keyword arguments (raypipe.serve.vllm_args) as the API server's command line."""
    cmd = [sys.executable, "-m", API_SERVER, "--host", "127.0.0.1", "--port", str(port)]
    return cmd + server_flags(engine, speculative) + ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]


def parse_counters(metrics: str) -> dict[str, float]:
    """The spec-decode counters of a Prometheus text page, summed over label sets (0 where absent)."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def level_summary(
    requests: list[dict[str, float]], seconds: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """One level's figures from its requests ({ttft, tpot, tokens}; tpot absent for one-token replies)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    tokens = sum(r["tokens"] for r in requests)
    tpots = [r["tpot"] for r in requests if "tpot" in r]
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_ms": {k: 1000 * v for k, v in _percentiles([r["ttft"] for r in requests]).items()},
        "tpot_ms": {k: 1000 * v for k, v in _percentiles(tpots).items()} if tpots else None,
        "drafts": drafts,
        "tau": 1.0 + accepted / drafts if drafts else None,
    }


async def _request(session: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"vLLM's server answered {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    result = {"ttft": first - start, "tokens": tokens}
    if tokens > 1:
        result["tpot"] = (last - first) / (tokens - 1)
    return result


async def _level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple:
    import aiohttp

    queue = list(reversed(prompts))
    results: list[dict[str, float]] = []

    async def client(session: Any) -> None:
        while queue:
            results.append(await _request(session, url, model, queue.pop(), max_tokens))

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(server: subprocess.Popen, url: str, log: Any, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM's OpenAI server exited with {server.returncode} before it was up:\n{tail}")
        try:
            _get(f"{url}/health")
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vLLM's OpenAI server was not up after {timeout_s:.0f} s")


def sweep(
    engine: dict[str, Any],
    speculative: dict[str, Any] | None,
    prompts: list[list[int]],
    levels: list[int],
    max_tokens: int,
    label: str,
) -> list[dict[str, Any]]:
    """Start the server, run every level in turn (a short warm-up first), stop the server; a row per level."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        # Its own session: the server's engine-core process goes with it when the group is signalled.
        server = subprocess.Popen(
            server_command(engine, speculative, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_until_up(server, url, log)
            asyncio.run(_level(url, engine["model"], prompts[:2], 2, 8))  # warm-up
            rows = []
            for concurrency in levels:
                before = parse_counters(_get(f"{url}/metrics"))
                requests, seconds = asyncio.run(_level(url, engine["model"], prompts, concurrency, max_tokens))
                row = level_summary(requests, seconds, before, parse_counters(_get(f"{url}/metrics")))
                rows.append({"drafter": label, "concurrency": concurrency, **row})
            logger("eval").info(
                f"latency, {label} drafter, at concurrency "
                + "; ".join(
                    f"{r['concurrency']}: TPOT {r['tpot_ms']['mean']:.1f} ms, TTFT {r['ttft_ms']['mean']:.1f} ms, "
                    f"{r['tokens_per_s']:.0f} tokens/s"
                    for r in rows
                )
            )
            return rows
        finally:
            stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core too), SIGKILL after a minute."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:  # the group is gone already
        server.wait()
