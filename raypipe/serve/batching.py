"""Concurrent requests merged into engine calls by a token budget, not a request count.

Sequences vary from a few tokens to thousands; a budget keeps each engine call
near the size that fills the engine. The engine runs in a worker thread so
requests keep queueing (and merging) while it computes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class TokenBudgetBatcher:
    def __init__(self, run: Callable[[list[list[int]]], list[Any]], max_tokens: int) -> None:
        self.run = run
        self.max_tokens = max_tokens
        self.engine_calls = 0
        self._queue: asyncio.Queue[tuple[list[list[int]], asyncio.Future]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    def queued(self) -> int:
        return self._queue.qsize()

    async def submit(self, sequences: list[list[int]]) -> list[Any]:
        """Results for `sequences`, in order, computed together with whatever else is queued."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._loop())
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((sequences, future))
        return await future

    async def _loop(self) -> None:
        pending: tuple[list[list[int]], asyncio.Future] | None = None
        while True:
            group = [pending or await self._queue.get()]
            tokens = sum(map(len, group[0][0]))
            pending = None
            while not self._queue.empty():
                item = self._queue.get_nowait()
                size = sum(map(len, item[0]))
                if tokens + size > self.max_tokens:
                    pending = item  # opens the next call
                    break
                group.append(item)
                tokens += size
            sequences = [seq for seqs, _ in group for seq in seqs]
            self.engine_calls += 1
            try:
                results = await asyncio.to_thread(self.run, sequences)
            except Exception as err:  # noqa: BLE001 - every waiter learns why its call failed
                for _, future in group:
                    future.set_exception(err)
                continue
            start = 0
            for seqs, future in group:
                future.set_result(results[start : start + len(seqs)])
                start += len(seqs)
