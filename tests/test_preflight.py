"""What a config names on the driver's machine, checked once before any work starts (raypipe.preflight)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypipe.config import load_config
from raypipe.preflight import preflight, problems

RELATIVE = ("data.output=runs/demo/prepared", "train.output=runs/demo/train", "train.states.cache=runs/demo/cache")


def ray_job_package(root: Path) -> Path:
    """A folder where Ray unpacks `ray job submit --working-dir .` and runs the job's driver (Ray 2.60's layout)."""
    package = root / "session_2026-12-07_05-31-42_543490_1" / "runtime_resources" / "working_dir_files"
    package = package / "_ray_pkg_0123456789abcdef"
    package.mkdir(parents=True)
    return package


def test_a_jobs_relative_outputs_are_refused_naming_each_setting_and_the_fix(tmp_path, monkeypatch):
    """In a job, a relative output would land in Ray's copy of the working dir: deleted with Ray's session, renamed
    with every edit of the checkout (issue 40, item 9). The job stops before any work, with the settings to give."""
    package = ray_job_package(tmp_path)
    monkeypatch.chdir(package)  # the driver's working directory
    with pytest.raises(ValueError) as refused:
        preflight(load_config("demo"))
    message = str(refused.value)
    assert all(setting in message for setting in RELATIVE), message
    assert str(package) in message and "deletes" in message, message
    assert "data.output=$PWD/runs/demo/prepared train.output=$PWD/runs/demo/train" in message, message
    # Absolute paths and URLs are where the user put them; a relative eval.output is refused too.
    absolute = [f"data.output={tmp_path}/p", f"train.output={tmp_path}/t", "train.states.cache=s3://bucket/cache"]
    assert problems(load_config("demo", absolute)) == []
    [line] = problems(load_config("demo", [*absolute, "eval.output=evals"]))
    assert line.startswith("eval.output=evals: ") and "data.output" not in line, line


def test_relative_outputs_outside_a_job_stay_relative_to_the_working_directory(tmp_path, monkeypatch):
    """The README's direct command (`jobs/pipeline.py --recipe demo` in the checkout) writes its runs/ there."""
    monkeypatch.chdir(tmp_path)
    assert problems(load_config("demo")) == []
    monkeypatch.chdir(ray_job_package(tmp_path).parent)  # Ray's working_dir_files itself holds no job
    assert problems(load_config("demo")) == []
