"""The target's digest: what determines its weights (a local directory's files, a hub id's commit, a builtin's
builder), read cheaply, so that an upstream update re-runs what depends on the target and a copy of it does not."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from raypipe.target import BUILTIN_TARGETS, target_digest
from tests.helpers import hub_snapshot, local_target, serve_config


def digest(model: str | Path, **overrides: object) -> str:
    return target_digest(serve_config(str(model), **overrides))


def test_a_local_targets_digest_follows_its_config_and_weights_not_where_or_when_it_was_copied(tmp_path: Path) -> None:
    target = local_target(tmp_path / "model")
    first = digest(target)
    assert digest(target) == first

    copy = Path(shutil.copytree(target, tmp_path / "copy", copy_function=shutil.copy))  # new mtimes
    os.utime(copy / "model.safetensors", (1, 1))
    (copy / "README.md").write_text("an edited model card\n")
    (copy / ".cache").mkdir()  # huggingface_hub's download metadata
    (copy / ".cache" / "model.safetensors.metadata").write_text("etag, time")
    assert digest(copy) == first, "the same weights, copied and documented"

    local_target(copy, scale=2.0)  # retrained upstream: the same shapes, other values
    retrained = digest(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    assert len({first, retrained, digest(copy)}) == 3


def test_a_hub_targets_digest_is_the_commit_it_resolves_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    old, new = "a" * 40, "b" * 40
    hub_snapshot(tmp_path, "org/model", old)
    first = digest("org/model")
    hub_snapshot(tmp_path, "org/model", new)  # the same config.json, a new commit upstream
    assert digest("org/model") != first
    # A pinned revision (vLLM's `revision`, in serve.engine_kwargs) is what the engines load.
    assert digest("org/model", engine_kwargs={"revision": old}) == first
    assert digest("org/model", engine_kwargs={"revision": new}) == digest("org/model")


def test_a_builtin_targets_digest_is_its_builders_stamp_without_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import raypipe.assets.demo_target as demo
    import raypipe.assets.tiny_target as tiny

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the digest built the target")

    monkeypatch.setattr(tiny, "build_tiny_target", refuse)
    monkeypatch.setattr(demo, "build_demo_target", refuse)
    digests = {model: digest(model) for model in BUILTIN_TARGETS}
    assert len(set(digests.values())) == len(BUILTIN_TARGETS)
    monkeypatch.setattr(tiny, "TINY_TARGET_VERSION", tiny.TINY_TARGET_VERSION + "-next")
    assert digest("builtin:tiny") != digests["builtin:tiny"] and digest("builtin:demo") == digests["builtin:demo"]
