"""Which failures the client resubmits, against a stand-in handle (no cluster): a replica whose vLLM engine died is
replaced by Serve, so its EngineDeadError is retried like a dead replica, and so is a failed write of the states (a
full /dev/shm); the replica's other errors are raised at once (issue 40's chaos run: an engine core killed mid-epoch,
and /dev/shm filled for 5 s, each cost a worker-group restart before)."""

from __future__ import annotations

from typing import Any

import pytest
from ray.exceptions import RayTaskError

from raypipe.serve.client import HiddenStateClient
from raypipe.serve.transport import ShortStateFile


class EngineDeadError(RuntimeError):
    """vLLM's name for it (the client matches the name; this process need not import vLLM)."""


class Refused(ValueError):
    pass


def _from_replica(cause: Exception) -> Exception:
    """The exception a Serve handle raises for one the replica raised: RayTaskError(cause), an instance of both."""
    return RayTaskError("HiddenStateService.extract", "Traceback ...", cause).as_instanceof_cause()


class _Response:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def result(self, timeout_s: float) -> Any:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        pass


class _Handle:
    """extract.remote() answers with the next outcome."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes
        self.extract = self

    def remote(self, batch: list[list[int]], **where: Any) -> _Response:
        return _Response(self.outcomes.pop(0))


class _Context:
    def get_node_id(self) -> str:
        return "node"


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ray.get_runtime_context", _Context)  # no Ray runtime context needed


def _client(outcomes: list[Any], replace_s: float = 0.0) -> HiddenStateClient:
    return HiddenStateClient(
        _Handle(outcomes), max_in_flight=4, timeout_s=1.0, retries=3, backoff_s=0.0, replace_s=replace_s
    )


def test_a_dead_engine_is_retried_until_the_replaced_replica_answers() -> None:
    dead = _from_replica(EngineDeadError("EngineCore encountered an issue."))
    assert isinstance(dead, RayTaskError) and isinstance(dead, EngineDeadError)
    client = _client([dead, dead, ["states"]])
    assert client.extract([[1, 2, 3]]) == ["states"] and client.resubmitted == 2


def test_a_failed_write_of_the_states_is_asked_again() -> None:
    failed = _from_replica(ShortStateFile("state file /dev/shm/x was never written"))
    client = _client([failed, ["states"]])
    assert client.extract([[1, 2, 3]]) == ["states"] and client.resubmitted == 1


def test_the_replicas_other_errors_are_raised_at_once() -> None:
    client = _client([_from_replica(Refused("token id outside the vocabulary")), ["never asked"]])
    with pytest.raises(Refused):
        client.extract([[1, 2, 3]])
    assert client.resubmitted == 0


def test_a_dead_engine_that_stays_dead_is_raised_after_the_retries() -> None:
    dead = _from_replica(EngineDeadError("EngineCore encountered an issue."))
    client = _client([dead] * 4)
    with pytest.raises(EngineDeadError):
        client.extract([[1]])
    assert client.resubmitted == 3


def test_a_lost_replica_is_asked_again_until_it_may_have_been_replaced_whatever_the_retry_count() -> None:
    """Serve replaces a replica whose engine died after its health check fails, then a new engine starts: that took 39 s
    on the demo, longer than the retries' sleeps (the CI chaos run lost its trainers after 3 quick retries)."""
    dead = _from_replica(EngineDeadError("EngineCore encountered an issue."))
    client = _client([dead] * 6 + [["states"]], replace_s=60.0)
    assert client.extract([[1]]) == ["states"] and client.resubmitted == 6
