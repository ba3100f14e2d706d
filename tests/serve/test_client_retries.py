"""The client's retries, without Ray: what it waits for, how long it sleeps between tries, and what it removes of a
cancelled request (issue 40: each timeout cancelled and resubmitted at the same deadline, with no jitter, and the files
a cancelled request was handed anyway left until the trainer exits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import GetTimeoutError

from raypipe.serve import client as client_module
from raypipe.serve.client import HiddenStateClient
from raypipe.serve.transport import OWNER, PREFIX, process_identity, release_request


class Response:
    """A Serve response that times out `slow` times before it answers."""

    def __init__(self, log: dict[str, list], slow: int, tag: str) -> None:
        self.log, self.slow, self.tag = log, slow, tag

    def result(self, timeout_s: float) -> list[str]:
        self.log["timeouts"].append(timeout_s)
        if len(self.log["timeouts"]) <= self.slow:
            raise GetTimeoutError("timed out")
        return [self.tag]

    def cancel(self) -> None:
        self.log["cancelled"].append(self.tag)


class Extract:
    def __init__(self, log: dict[str, list], slow: int) -> None:
        self.log, self.slow = log, slow

    def remote(self, batch: list[list[int]], tag: str, **where: Any) -> Response:
        self.log["tags"].append(tag)
        return Response(self.log, self.slow, tag)


class Handle:
    def __init__(self, slow: int) -> None:
        self.log: dict[str, list] = {"timeouts": [], "cancelled": [], "tags": [], "sleeps": []}
        self.extract = Extract(self.log, slow)


class Context:
    def get_node_id(self) -> str:
        return "node"


@pytest.fixture
def handle(monkeypatch: pytest.MonkeyPatch) -> Handle:
    handle = Handle(slow=3)
    monkeypatch.setattr("ray.get_runtime_context", Context)
    monkeypatch.setattr(client_module.time, "sleep", handle.log["sleeps"].append)
    return handle


def test_each_retry_waits_longer_sleeps_a_jittered_time_and_asks_under_a_new_tag(handle: Handle) -> None:
    client = HiddenStateClient(handle, timeout_s=10.0, retries=6, backoff_s=1.0)
    [tag] = client.extract([[1, 2, 3]])
    log = handle.log
    assert log["timeouts"] == [10.0, 20.0, 40.0, 40.0]  # twice as long each time, up to 4 times the first
    assert client.resubmitted == 3 and log["cancelled"] == log["tags"][:3] and tag == log["tags"][3]
    assert len(set(log["tags"])) == 4  # a late answer to a cancelled request is never taken for the new one
    assert all(0 <= s <= 2**i for i, s in enumerate(log["sleeps"])) and len(set(log["sleeps"])) == 3
    assert set(client.cancelled) == set(log["tags"][:3])  # looked for in the owner folder at the next results


def test_two_clients_that_failed_together_do_not_retry_together(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps = []
    monkeypatch.setattr("ray.get_runtime_context", Context)
    monkeypatch.setattr(client_module.time, "sleep", sleeps.append)
    for _ in range(2):
        HiddenStateClient(Handle(slow=2), timeout_s=1.0, retries=6, backoff_s=1.0).extract([[1]])
    assert sleeps[:2] != sleeps[2:]


def test_release_request_removes_only_that_requests_files_handed_to_that_trainer(tmp_path: Path) -> None:
    me = process_identity()
    mine, other = tmp_path / f"{PREFIX}7-a" / f"{OWNER}{me}", tmp_path / f"{PREFIX}7-a" / f"{OWNER}1.2.3"
    for folder in (mine, other):
        folder.mkdir(parents=True)
        for name in ("cancelled-0", "cancelled-1", "served-0"):
            (folder / f"{name}.safetensors").write_bytes(b"x")
    assert release_request(me, "cancelled", root=str(tmp_path)) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["served-0.safetensors"]
    assert len(list(other.iterdir())) == 3
