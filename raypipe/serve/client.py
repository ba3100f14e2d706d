"""The trainer's side of the service: prefetching, bounded, in order, retrying only what can succeed.

`stream(batches)` keeps up to `max_in_flight` extraction requests in flight
ahead of the consumer (so extraction for the next steps overlaps the current
one) and yields results in submission order. Each request names this
process's node and pid, so a replica on the same node hands the states over
as files this process owns (raypipe.serve.transport), and one elsewhere sends
arrays. A request that times out is cancelled (the replica aborts it in the
engine) and resubmitted; one whose replica died, whose replica's engine died
(vLLM's EngineDeadError: the replica fails its health check and Serve
replaces it), or whose states the engine failed to write (ShortStateFile: a
full /dev/shm) is resubmitted, with exponential backoff; each batch's result
is yielded exactly once. Any other error the replica raised (a refused
request, a failed check) is deterministic and raised at once.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raypipe.serve.transport import ShortStateFile

ENGINE_DEAD = "EngineDeadError"  # vLLM's, matched by name: the trainer's process need not import vLLM


def _transient(err: BaseException) -> bool:
    """The replica raised vLLM's EngineDeadError (its engine core is gone; the replica is about to be replaced) or
    ShortStateFile (the engine's write failed)."""
    return isinstance(err, RayTaskError) and (
        isinstance(err, ShortStateFile) or any(c.__name__ == ENGINE_DEAD for c in type(err).__mro__)
    )


class HiddenStateClient:
    def __init__(
        self, handle: Any, max_in_flight: int = 4, timeout_s: float = 300.0, retries: int = 6, backoff_s: float = 0.5
    ) -> None:
        import ray

        self.handle = handle
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.resubmitted = 0
        self.where = {"node_id": ray.get_runtime_context().get_node_id(), "owner_pid": os.getpid()}

    def _submit(self, batch: list[list[int]]) -> Any:
        if not batch:
            return None  # nothing to ask for (e.g. every sequence was a cache hit)
        return self.handle.extract.remote(batch, **self.where)

    def _result(self, batch: list[list[int]], response: Any) -> list[Any]:
        for attempt in range(self.retries + 1):
            if response is None:
                return []
            try:
                return response.result(timeout_s=self.timeout_s)
            except (GetTimeoutError, TimeoutError, RayActorError, RayTaskError) as err:
                # timed out (cancelled below), the replica or its engine is gone, or the engine's write failed
                if attempt == self.retries or (isinstance(err, RayTaskError) and not _transient(err)):
                    raise
                response.cancel()
                time.sleep(self.backoff_s * 2**attempt)
                self.resubmitted += 1
                response = self._submit(batch)
        raise AssertionError("unreachable")

    def extract(self, batch: list[list[int]]) -> list[Any]:
        return self._result(batch, self._submit(batch))

    def stream(self, batches: Iterable[list[list[int]]]) -> Iterator[list[Any]]:
        """Extraction results per batch, in order, with up to `max_in_flight` requests ahead of the consumer."""
        pending: deque[tuple[list[list[int]], Any]] = deque()
        for batch in batches:
            pending.append((batch, self._submit(batch)))
            if len(pending) >= self.max_in_flight:
                done, response = pending.popleft()
                yield self._result(done, response)
        while pending:
            batch, response = pending.popleft()
            yield self._result(batch, response)
