"""The trainer's side of the service: prefetching, bounded, in order, retrying only what can succeed.

`stream(batches)` keeps up to `max_in_flight` extraction requests in flight
ahead of the consumer (so extraction for the next steps overlaps the current
one) and yields results in submission order. Each request names this
process's node and identity (pid, start time, pid namespace), so a replica
on the same node hands the states over as files this process owns
(raypipe.serve.transport), and one elsewhere sends arrays. Each batch's
result is yielded exactly once. An error the replica raised (a refused
request, a failed check) is deterministic and raised at once.

A request that times out is cancelled, which the replica turns into aborts in
the engine (raypipe.serve.deployment), so its retry replaces its work instead
of queueing behind it. One whose replica died, whose replica's engine died
(vLLM's EngineDeadError: the replica fails its health check and Serve
replaces it), or whose states the engine failed to write (ShortStateFile: a
full /dev/shm) is resubmitted, for as long as Serve may take to replace the
replica (REPLACE_S) however many tries that takes. Retries wait a random time
up to an exponentially growing bound (full jitter: clients that failed
together do not come back together), and each attempt waits twice as long as
the one before,
up to 4 times the first, so a request that is slow rather than lost (long
prefills under load) gets done instead of being restarted at the same
deadline every time. Files a cancelled request was
handed anyway (the replica had finished it as the cancel came) are removed
by name at the next results.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raypipe.serve.transport import STALE_S, ShortStateFile, process_identity, release_request

MAX_BACKOFF_S = 10.0
# A replica lost (dead, or its engine dead) is asked again for at least this long, whatever the retry count: Serve
# notices by its health check and starts a new replica, whose engine takes minutes to load a large target.
REPLACE_S = 600.0
ENGINE_DEAD = "EngineDeadError"  # vLLM's, matched by name: the trainer's process need not import vLLM


def _transient(err: BaseException) -> bool:
    """The replica raised vLLM's EngineDeadError (its engine core is gone; the replica is about to be replaced) or
    ShortStateFile (the engine's write failed)."""
    return isinstance(err, RayTaskError) and (
        isinstance(err, ShortStateFile) or any(c.__name__ == ENGINE_DEAD for c in type(err).__mro__)
    )


class HiddenStateClient:
    def __init__(
        self,
        handle: Any,
        max_in_flight: int = 4,
        timeout_s: float = 300.0,
        retries: int = 6,
        backoff_s: float = 0.5,
        replace_s: float = REPLACE_S,
    ) -> None:
        import ray

        self.handle = handle
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.replace_s = replace_s
        self.resubmitted = 0
        self.where = {"node_id": ray.get_runtime_context().get_node_id(), "owner": process_identity()}
        # tag of a cancelled request: (its sequences not yet found handed over, until when they are looked for)
        self.cancelled: dict[str, tuple[int, float]] = {}
        self._jitter = random.Random()

    def _submit(self, batch: list[list[int]]) -> tuple[str, Any] | None:
        if not batch:
            return None  # nothing to ask for (e.g. every sequence was a cache hit)
        tag = uuid.uuid4().hex
        return tag, self.handle.extract.remote(batch, tag=tag, **self.where)

    def _result(self, batch: list[list[int]], submitted: tuple[str, Any] | None) -> list[Any]:
        attempt, lost_since = 0, None
        while submitted is not None:
            tag, response = submitted
            try:
                states = response.result(timeout_s=self.timeout_s * min(2**attempt, 4))
            except (GetTimeoutError, TimeoutError, RayActorError, RayTaskError) as err:
                # timed out (cancelled below), the replica or its engine is gone, or the engine's write failed
                if isinstance(err, RayTaskError) and not _transient(err):
                    raise
                if lost_since is None and not isinstance(err, (GetTimeoutError, TimeoutError)):
                    lost_since = time.monotonic()
                replaced = lost_since is None or time.monotonic() - lost_since >= self.replace_s
                if attempt >= self.retries and replaced:
                    raise
                response.cancel()
                self.cancelled[tag] = (len(batch), time.monotonic() + STALE_S)
                time.sleep(self._jitter.uniform(0, min(self.backoff_s * 2**attempt, MAX_BACKOFF_S)))
                self.resubmitted += 1
                attempt += 1
                submitted = self._submit(batch)
                continue
            self._release_cancelled()
            return states
        return []

    def _release_cancelled(self) -> None:
        """Remove what cancelled requests were handed anyway; a request's files arrive together or not at all, but
        may arrive after its cancel, so each tag is looked for until all its sequences were found or STALE_S passed."""
        for tag, (left, until) in list(self.cancelled.items()):
            left -= release_request(self.where["owner"], tag)
            if left > 0 and time.monotonic() < until:
                self.cancelled[tag] = (left, until)
            else:  # all found, or aborted before they were computed; release_owner takes any late one at exit
                del self.cancelled[tag]

    def extract(self, batch: list[list[int]]) -> list[Any]:
        return self._result(batch, self._submit(batch))

    def stream(self, batches: Iterable[list[list[int]]]) -> Iterator[list[Any]]:
        """Extraction results per batch, in order, with up to `max_in_flight` requests ahead of the consumer."""
        pending: deque[tuple[list[list[int]], tuple[str, Any] | None]] = deque()
        for batch in batches:
            pending.append((batch, self._submit(batch)))
            if len(pending) >= self.max_in_flight:
                done, response = pending.popleft()
                yield self._result(done, response)
        while pending:
            batch, response = pending.popleft()
            yield self._result(batch, response)
