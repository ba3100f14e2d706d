"""Training fixtures: a small prepared dataset with needs_response rows, its replies, and the real vLLM hidden-state
service; the helpers they use are in tests/train/helpers.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raypipe.layout import RunFolders
from raypipe.storage import Storage
from tests.train.helpers import prepare_sample, run_config


@pytest.fixture(scope="session")
def prepared(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 raw rows of the bundled sample (prompt-only rows among them), prepared by the real data stage."""
    root = tmp_path_factory.mktemp("train_data")
    manifest = prepare_sample(root, 240, 160)
    assert manifest["counts"]["needs_response"] > 0
    return root


@pytest.fixture(scope="session")
def replies(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """The reply pass, run once by the real engine over `prepared`: every training test trains on these rows with
    this target and sampling, so each takes a copy (`with_replies`) and its own pass finds nothing left to do, as a
    resumed run's does."""
    from raypipe.train.replies import run_replies

    cfg = run_config(prepared, tmp_path_factory.mktemp("replies"))
    assert run_replies(cfg)["replies"] > 0
    return RunFolders.of(cfg).replies


@pytest.fixture(scope="session")
def service(prepared: Path) -> Iterator[Any]:
    """The hidden-state service as the trainer finds it: the real vLLM engine on the tiny target, in a Serve replica."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME, build_app

    cfg = run_config(prepared, prepared)
    handle = serve.run(build_app(cfg.serve), name=APP_NAME, route_prefix=None)
    yield handle
    serve.delete(APP_NAME)
