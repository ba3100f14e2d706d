"""The trainer's side of the service: prefetching, bounded, retrying, in order.

`stream(batches, method)` keeps up to `max_in_flight` requests in flight ahead of the
consumer (so extraction for the next steps overlaps the current one) and
yields results in submission order. A request that fails because its replica
died or timed out is resubmitted with exponential backoff; each batch's result
is yielded exactly once, so nothing is lost or returned twice. A refused
request (`BadRequest`) is the caller's bug and is raised at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from raypipe.serve.validate import BadRequest


class HiddenStateClient:
    def __init__(self, handle: Any, max_in_flight: int = 4, timeout_s: float = 300.0, retries: int = 6, backoff_s: float = 0.5) -> None:
        self.handle = handle
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.resubmitted = 0

    def _submit(self, method: str, batch: list[list[int]], kwargs: dict[str, Any]) -> Any:
        if not batch:
            return None  # nothing to ask for (e.g. every sequence was a cache hit)
        return getattr(self.handle, method).remote(batch, **kwargs)

    def _result(self, method: str, batch: list[list[int]], kwargs: dict[str, Any], response: Any) -> list[Any]:
        for attempt in range(self.retries + 1):
            if response is None:
                return []
            try:
                return response.result(timeout_s=self.timeout_s)
            except BadRequest:
                raise
            except Exception:  # noqa: BLE001 - a dead replica, a timeout, a restarting deployment
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff_s * 2**attempt)
                self.resubmitted += 1
                response = self._submit(method, batch, kwargs)
        raise AssertionError("unreachable")

    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        return self._result("extract", batch, {}, self._submit("extract", batch, {}))

    def stream(self, batches: Iterable[list[list[int]]], method: str = "extract", **kwargs: Any) -> Iterator[list[Any]]:
        """Results of `method` per batch, in order, with up to `max_in_flight` requests ahead of the consumer."""
        pending: deque[tuple[list[list[int]], Any]] = deque()
        for batch in batches:
            pending.append((batch, self._submit(method, batch, kwargs)))
            if len(pending) >= self.max_in_flight:
                done, response = pending.popleft()
                yield self._result(method, done, kwargs, response)
        while pending:
            batch, response = pending.popleft()
            yield self._result(method, batch, kwargs, response)
