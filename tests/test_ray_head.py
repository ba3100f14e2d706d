"""The Ray head a command would join, and a dead one told within seconds (raypipe.ray_head; issue 40, item 10).

The current-cluster file is a temporary one here: this machine's /tmp/ray/ray_current_cluster belongs to the Ray
instances running on it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from raypipe.ray_head import Head, check_head, head_to_join
from tests.helpers import free_port


def test_the_head_to_join_follows_rays_rule(tmp_path: Path) -> None:
    recorded = tmp_path / "ray_current_cluster"
    assert head_to_join({}, recorded) is None  # no file: ray.init starts a local instance
    recorded.write_text("10.0.0.5:6379\n")
    assert head_to_join({}, recorded) == Head("10.0.0.5:6379", str(recorded))
    assert head_to_join({"RAY_ADDRESS": "auto"}, recorded) == Head("10.0.0.5:6379", str(recorded))
    assert head_to_join({"RAY_ADDRESS": ""}, recorded) == Head("10.0.0.5:6379", str(recorded))
    assert head_to_join({"RAY_ADDRESS": "10.0.0.6:6380"}, recorded) == Head("10.0.0.6:6380", "RAY_ADDRESS")
    assert head_to_join({"RAY_ADDRESS": "local"}, recorded) is None  # a fresh local instance, whatever the file says


def test_a_dead_head_is_refused_naming_its_address_where_it_came_from_and_the_fix(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    recorded = tmp_path / "ray_current_cluster"
    recorded.write_text(dead)
    with pytest.raises(ValueError) as refused:
        check_head({}, recorded)
    message = str(refused.value)
    assert message.startswith(f"the Ray head at {dead} (recorded in {recorded}) does not answer: "), message
    assert "killed without `ray stop`" in message and "Fix: `ray stop`" in message, message
    assert "RAY_ADDRESS=local" in message, message
    with pytest.raises(
        ValueError, match=rf"the Ray head at {dead} \(RAY_ADDRESS\) does not answer: .*RAY_ADDRESS=local"
    ):
        check_head({"RAY_ADDRESS": dead}, tmp_path / "none")
    assert check_head({"RAY_ADDRESS": "local"}, recorded) is None


def test_a_head_that_answers_is_joined(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as gcs:  # a port that takes connections, as a live GCS does
        address = f"127.0.0.1:{gcs.getsockname()[1]}"
        (tmp_path / "ray_current_cluster").write_text(address)
        assert check_head({}, tmp_path / "ray_current_cluster") == Head(address, str(tmp_path / "ray_current_cluster"))
        assert check_head({"RAY_ADDRESS": f"ray://{address}"}, tmp_path / "none") == Head(
            f"ray://{address}", "RAY_ADDRESS"
        )
