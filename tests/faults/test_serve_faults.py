"""The service under cancellation: the real vLLM CPU engine on the tiny target in a Serve replica, several clients at
once.

A request cancelled while it waits or while the engine computes it must not
hurt any other request nor leave a state file behind (in the replica's
directory or handed over to the caller), and the replica stays healthy.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import RequestCancelledError

from raypipe.serve.deployment import HiddenStateService, engine_process_options
from raypipe.serve.transport import OWNER, as_tensor, process_identity, release_owner, release_request
from tests.helpers import serve_config

pytestmark = pytest.mark.integration
LAYERS = [1, 2, 4]
HIDDEN = 64
RESULT_TIMEOUT_S = 120  # a request that hangs fails the test instead of blocking it


@pytest.fixture(scope="module")
def service(ray_cluster: str, tiny_target: str) -> Any:
    cfg = serve_config(tiny_target, layer_ids=LAYERS, canary="off")
    app = HiddenStateService.options(ray_actor_options=engine_process_options(cfg), max_ongoing_requests=64).bind(cfg)
    handle = serve.run(app, name="hidden_states_faults", route_prefix=None)
    yield handle
    serve.delete("hidden_states_faults")


def _where(local: bool) -> dict[str, Any]:
    """Ask as a trainer on this node (states handed over as files this process owns) or on another node (arrays)."""
    if local:
        return {"node_id": ray.get_runtime_context().get_node_id(), "owner": process_identity()}
    return {"node_id": "another-node", "owner": "1.1.1"}


def _check_states(batch: list[list[int]], states: list[Any]) -> None:
    assert len(states) == len(batch)
    for ids, got in zip(batch, states):
        tensor = as_tensor(got)  # a handed-over file is read and removed here
        assert tuple(tensor.shape) == (len(ids), len(LAYERS), HIDDEN) and bool(tensor.isfinite().all())


def _outcome(batch: list[list[int]], response: Any, cancelled: bool) -> str:
    """served; cancelled (raised as such, for a cancelled request only); finished (cancelled too late, its states
    intact)."""
    try:
        states = response.result(timeout_s=RESULT_TIMEOUT_S)
    except (RequestCancelledError, TaskCancelledError):
        assert cancelled, "a request nobody cancelled was cancelled"
        return "cancelled"
    _check_states(batch, states)
    return "finished" if cancelled else "served"


def _leftovers(directory: Path, owner: bool = True) -> list[str]:
    """State files or locks still in the replica's directory, and (`owner`) anything handed over to this process and not
    read."""
    return sorted(
        str(p)
        for p in directory.rglob("*")
        if p.is_file() and (p.parent == directory or owner and p.parent.name == f"{OWNER}{process_identity()}")
    )


def _settled(service: Any, owner: bool = True, timeout_s: float = 60) -> tuple[dict[str, Any], list[str]]:
    """Stats and leftovers once the replica has no sequence in flight (cancelled requests unwind asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = service.stats.remote().result(timeout_s=RESULT_TIMEOUT_S)
        left = _leftovers(Path(stats["directory"]), owner)
        if (stats["in_flight"] == 0 and not left) or time.monotonic() > deadline:
            return stats, left
        time.sleep(0.5)


def _in_the_engine(service: Any, timeout_s: float = 60) -> None:
    """Wait until the replica has sequences inside its engine."""
    deadline = time.monotonic() + timeout_s
    while service.stats.remote().result(timeout_s=RESULT_TIMEOUT_S)["in_flight"] == 0:
        assert time.monotonic() < deadline, "no sequence reached the engine"
        time.sleep(0.05)


def _batch(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 150_000) for _ in range(rng.randrange(8, 200))] for _ in range(rng.randrange(1, 4))]


def test_cancelled_requests_hurt_no_other_request_and_leave_no_file(service: Any) -> None:
    rng = random.Random(13)
    # A long generation holds engine slots, so some extraction sequences wait in vLLM's queue while others run.
    long = service.generate.remote([[9707, 1879]] * 4, {"max_tokens": 200})
    batches = [_batch(rng) for _ in range(16)]
    responses = [service.extract.remote(b, tag=f"hurt-{i}", **_where(i % 2 == 0)) for i, b in enumerate(batches)]
    cancelled = set(range(0, 16, 3))
    for i in sorted(cancelled):
        if i > 8:
            time.sleep(0.2)  # the later ones once the engine has them
        responses[i].cancel()
    outcomes = [
        _outcome(batch, response, i in cancelled) for i, (batch, response) in enumerate(zip(batches, responses))
    ]
    assert outcomes.count("served") == 16 - len(cancelled) and "cancelled" in outcomes, outcomes
    assert len(long.result(timeout_s=RESULT_TIMEOUT_S)) == 4
    # Nothing stays in the replica's directory. A cancel that reaches Serve after the replica returned is reported
    # as cancelled, though its files were handed over: at most the cancelled requests' sequences wait in this
    # process's owner folder, named by their request's tag, and the client removes them by it.
    stats, left = _settled(service, owner=False)
    assert stats["in_flight"] == 0 and not left, left
    handed = _leftovers(Path(stats["directory"]))
    assert len(handed) <= sum(len(batches[i]) for i in cancelled if outcomes[i] == "cancelled"), handed
    for i in cancelled:
        release_request(process_identity(), f"hurt-{i}")
    assert not _leftovers(Path(stats["directory"]))
    service.check_health.remote().result(timeout_s=RESULT_TIMEOUT_S)
    _check_states([[1, 2, 3]], service.extract.remote([[1, 2, 3]], **_where(True)).result(timeout_s=RESULT_TIMEOUT_S))


def test_a_cancelled_request_is_aborted_in_the_engine_and_leaves_no_file(service: Any) -> None:
    """Issue 40: the replica let every engine request of a cancelled call run to its end, a full prefill each, so a
    client's timeout and retry doubled the work of an overloaded engine. Now the engine requests of a cancelled call are
    aborted: those not yet computed cost nothing, and the files of those computed are removed by their known names."""
    rng = random.Random(5)
    batches = [[[rng.randrange(1, 150_000) for _ in range(250)] for _ in range(8)] for _ in range(12)]
    before = service.stats.remote().result(timeout_s=RESULT_TIMEOUT_S)["aborted"]
    responses = [service.extract.remote(b, tag=f"abort-{i}", **_where(i % 2 == 0)) for i, b in enumerate(batches)]
    _in_the_engine(service)  # a call cancelled before the replica runs it never reaches the engine: nothing to abort
    for response in responses:
        response.cancel()  # 96 sequences of 250 tokens: most are still waiting in the engine
    outcomes = [_outcome(b, r, cancelled=True) for b, r in zip(batches, responses)]
    stats, left = _settled(service, owner=False)
    assert stats["aborted"] - before > 0, (outcomes, stats)
    assert stats["in_flight"] == 0 and not left, left
    for i in range(len(batches)):
        release_request(process_identity(), f"abort-{i}")
    assert not _leftovers(Path(stats["directory"]))
    _check_states([[1, 2, 3]], service.extract.remote([[1, 2, 3]], **_where(True)).result(timeout_s=RESULT_TIMEOUT_S))


def test_soak_several_clients_cancelling_at_random_no_request_hangs_and_the_replica_stays_healthy(service: Any) -> None:
    """4 clients, 24 requests each (96 in all, 1-3 sequences of 8-200 tokens), about a quarter cancelled at a random
    moment."""
    clients, per_client = 4, 24
    before = service.stats.remote().result(timeout_s=RESULT_TIMEOUT_S)["requests"]
    outcomes: dict[str, int] = {"served": 0, "cancelled": 0, "finished": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        in_flight: list[tuple[list[list[int]], Any, bool]] = []
        try:
            for n in range(per_client):
                batch = _batch(rng)
                response = service.extract.remote(batch, **_where(rng.random() < 0.5))
                cancel = rng.random() < 0.25
                in_flight.append((batch, response, cancel))
                if cancel:
                    time.sleep(rng.uniform(0, 0.3))  # waiting, in the engine, or already done
                    response.cancel()
                if (
                    len(in_flight) == 3 or n == per_client - 1
                ):  # up to 3 requests in flight per client, as a trainer prefetches
                    for b, r, c in in_flight:
                        kind = _outcome(b, r, c)  # a hang raises TimeoutError
                        with lock:
                            outcomes[kind] += 1
                    in_flight.clear()
        except Exception as err:  # noqa: BLE001 - reported by the test thread
            with lock:
                errors.append(f"client {seed}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RESULT_TIMEOUT_S * per_client)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors
    print(outcomes)
    assert sum(outcomes.values()) == clients * per_client
    assert outcomes["cancelled"] > 0 and outcomes["served"] > 0.5 * clients * per_client
    stats, left = _settled(service, owner=False)
    assert stats["in_flight"] == 0 and not left, left
    # As above: late cancels leave their handed-over files in this process's owner folder, up to 3 per request.
    owned = _leftovers(Path(stats["directory"]))
    assert len(owned) <= 3 * outcomes["cancelled"], owned
    release_owner(process_identity())
    assert stats["requests"] - before >= outcomes["served"]
    service.check_health.remote().result(timeout_s=RESULT_TIMEOUT_S)
    batch = [list(range(5, 45))]
    _check_states(batch, service.extract.remote(batch, **_where(True)).result(timeout_s=RESULT_TIMEOUT_S))
