"""The command line and the job entrypoint, as a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_help_lists_subcommands_and_overrides():
    top = run("-m", "raypipe.cli", "--help")
    assert top.returncode == 0 and "prepare" in top.stdout and "check-drafter" in top.stdout
    prepare = run("-m", "raypipe.cli", "prepare", "--help")
    assert prepare.returncode == 0 and "--recipe" in prepare.stdout and "key=value" in prepare.stdout


def test_invalid_override_fails_early_naming_the_field():
    out = run("-m", "raypipe.cli", "prepare", "--recipe", "debug_cpu", "data.overlength=cut")
    assert out.returncode == 2
    assert "data.overlength" in out.stderr and "'truncate' or 'reject'" in out.stderr
    assert "Traceback" not in out.stderr


def test_unparsable_override_is_one_line_naming_it():
    out = run("-m", "raypipe.cli", "prepare", "--recipe", "demo", "data.sources=[{path:")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [out.stderr.strip()]  # one line, no parser traceback
    assert "override 'data.sources=[{path:' is not valid YAML" in out.stderr


def test_missing_input_is_explained(tmp_path):
    out = run(
        "-m",
        "raypipe.cli",
        "prepare",
        "--recipe",
        "debug_cpu",
        f"data.sources=[{{path: '{tmp_path}/none/*.jsonl'}}]",
        f"data.output={tmp_path}/o",
    )
    assert out.returncode == 2 and "no .jsonl, .jsonl.gz or .parquet files match" in out.stderr


@pytest.mark.integration
def test_prepare_job_end_to_end_on_the_bundled_sample(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": "local"}
    out = run("jobs/prepare_data.py", "--recipe", "debug_cpu", f"data.output={tmp_path}/prepared", env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = json.loads((tmp_path / "prepared/manifest.json").read_text())
    c = manifest["counts"]
    assert c["rows_in"] == 3000 and c["rows_in"] + c["split_extra"] == c["rows_kept"] + c["rows_rejected"]
    assert c["needs_response"] > 2000 and c["loss_tokens"] > 0
    assert sorted(s["file"] for s in manifest["shards"]) == sorted(
        f"data/{p.name}" for p in (tmp_path / "prepared/data").iterdir()
    )


def test_a_dead_head_left_in_rays_current_cluster_file_stops_the_command_with_the_fix(tmp_path):
    """A head killed without `ray stop` leaves Ray's current-cluster file behind, and `ray.init()` joins its address,
    retrying the GCS for minutes (issue 40, item 10). The command stops at once with the fix instead. The file is made
    under RAY_TMPDIR, not in this machine's /tmp/ray, which other Ray instances use."""
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    recorded = tmp_path / "ray" / "ray_current_cluster"
    recorded.parent.mkdir()
    recorded.write_text(dead)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    out = run(
        "-m",
        "raypipe.cli",
        "prepare",
        "--recipe",
        "demo",
        f"data.output={tmp_path}/prepared",
        f"train.output={tmp_path}/train",
        env=env,
        timeout=120,  # a safety net: a hang fails here (TimeoutExpired) rather than blocking the suite
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"the Ray head at {dead} (recorded in {recorded}" in out.stderr, out.stderr[-3000:]
    assert "`ray stop`" in out.stderr and "RAY_ADDRESS=local" in out.stderr and "Traceback" not in out.stderr
