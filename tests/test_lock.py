"""The locks in locks/ match pyproject.toml, and scripts/bootstrap.sh installs them (raypipe/lock.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from raypipe.lock import KINDS, PIN, ROOT, problems


def test_every_lock_is_current() -> None:
    assert problems() == [], "pyproject.toml changed: run `.venv/bin/python -m raypipe.lock` and commit locks/"


def test_a_pin_edited_without_relocking_is_reported(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "locks", tmp_path / "locks")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"transformers==5.19.0"' in pyproject
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('"transformers==5.19.0"', '"transformers==5.19.1"'))
    assert problems(tmp_path) == [
        line
        for kind in KINDS
        for line in (
            f"locks/{kind}.txt was not made from this pyproject.toml",
            f"locks/{kind}.txt has transformers 5.19.0, pyproject.toml asks for transformers==5.19.1",
        )
    ]


def test_an_extra_edited_without_relocking_is_reported_for_its_kinds_only(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "locks", tmp_path / "locks")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"ruff==0.17.5"' in pyproject
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('"ruff==0.17.5"', '"ruff==0.17.6"'))
    assert problems(tmp_path) == [
        "locks/test.txt was not made from this pyproject.toml",
        "locks/test.txt has ruff 0.17.5, pyproject.toml asks for ruff==0.17.6",
    ]


def test_bootstrap_refuses_a_kind_without_a_lock() -> None:
    out = subprocess.run(["bash", "scripts/bootstrap.sh", "trackers"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    assert "no lock for 'trackers'; the kinds are: cpu gpu test tiny" in out.stderr


def test_this_environment_holds_its_lock() -> None:
    stamp = Path(sys.prefix) / ".raypipe-installed"
    if not stamp.is_file():
        pytest.skip("not installed by scripts/bootstrap.sh")
    kind = stamp.read_text().split()[1]
    wrong = []
    for name, version in PIN.findall((ROOT / "locks" / f"{kind}.txt").read_text()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong.append(f"{canonicalize_name(name)}: {installed}, locked {version}")
    assert wrong == [], f"run `bash scripts/bootstrap.sh {kind}`"
