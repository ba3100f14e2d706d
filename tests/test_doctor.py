"""`raypipe doctor` as a user runs it: a row per check, and a failing check's fix with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["ray", "vllm", "torch", "memory node 0", "engines fit", "/dev/shm", "port 6379", "port 8265", "port 8000"]
ROWS += [
    "ray head",
    "token auth",
    "storage data.output",
    "storage train.output",
    "config here",
]  # "memory node 1"... on NUMA


def doctor(
    *overrides: str, env: dict[str, str] | None = None, recipe: str = "demo", cluster: str | None = None
) -> tuple[int, dict[str, tuple[str, str]], str]:
    """(exit status, {check: (PASS or FAIL, detail or fix)}, output) of `raypipe doctor --recipe demo`."""
    options = ["--cluster", str(ROOT / cluster)] if cluster else []
    out = subprocess.run(
        [sys.executable, "-m", "raypipe.cli", "doctor", "--recipe", recipe, *options, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    _, header, *lines, _ = out.stdout.splitlines()  # title, header, rows, summary
    column = header.index("result")
    rows: dict[str, tuple[str, str]] = {}
    for line in lines:
        name, text = line[:column].strip(), line[column + 8 :]
        if name:
            last, rows[name] = name, (line[column : column + 4], text)
        else:  # the fix under a failed row
            rows[last] = (rows[last][0], text)
    return out.returncode, rows, out.stdout + out.stderr


def test_doctor_prints_each_check_of_the_demo_recipe(tmp_path):
    status, rows, out = doctor(f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train")
    assert [r for r in rows if not r.startswith("memory node ")] == [r for r in ROWS if r != "memory node 0"], out
    assert "memory node 0" in rows and rows["engines fit"][1].startswith("1 vLLM engine(s) need "), out
    assert rows["ray"][0] == rows["torch"][0] == "PASS", out
    assert rows["storage data.output"][0] == rows["storage train.output"][0] == "PASS", out
    failed = [name for name, (result, _) in rows.items() if result == "FAIL"]
    assert status == (1 if failed else 0), out
    assert all(rows[name][1].startswith("fix: ") for name in failed), out
    assert out.splitlines()[-1] == f"{len(rows)} checks, {len(failed)} failed"


def test_unreachable_storage_fails_and_names_the_fix(tmp_path):
    (tmp_path / "a_file").write_text("")
    status, rows, out = doctor(f"data.output={tmp_path}/a_file/prepared", f"train.output={tmp_path}/train")
    assert status == 1, out
    assert rows["storage data.output"] == (
        "FAIL",
        "fix: set data.output to a place this machine can write (and its storage_options for a URL)",
    ), out
    assert rows["storage train.output"][0] == "PASS", out


def test_what_the_config_names_on_this_machine_is_checked_here(tmp_path):
    """The config is pure (a template path is not looked for when it is validated): the doctor shows what the
    preflight of every command would refuse."""
    status, rows, out = doctor(
        f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", f"data.chat_template={tmp_path}/no.jinja"
    )
    assert status == 1 and rows["config here"][0] == "FAIL", out
    assert "data.chat_template: must be one of" in out and str(tmp_path / "no.jinja") in out, out


def test_a_dead_head_that_commands_would_join_fails_with_the_fix(tmp_path):
    """Ray's current-cluster file names a head killed without `ray stop` (issue 40, item 10): made under RAY_TMPDIR,
    not in this machine's /tmp/ray, which other Ray instances use."""
    dead = f"127.0.0.1:{free_port()}"
    recorded = tmp_path / "ray" / "ray_current_cluster"
    recorded.parent.mkdir()
    recorded.write_text(dead)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    status, rows, out = doctor(f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", env=env)
    assert status == 1 and rows["ray head"][0] == "FAIL", out
    assert f"the Ray head at {dead} (recorded in {recorded}) does not answer" in out, out
    assert rows["ray head"][1].startswith(f"fix: `ray stop` (it removes {recorded}"), out
    assert "RAY_ADDRESS=local" in rows["ray head"][1], out
    env["RAY_ADDRESS"] = "local"  # the other fix: a fresh local instance
    status, rows, out = doctor(f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", env=env)
    assert rows["ray head"] == ("PASS", "RAY_ADDRESS=local: commands start a local Ray instance"), out


def test_a_gpu_recipe_is_checked_against_the_cluster_files_gpus_shm_and_ami(tmp_path):
    """Qwen3.6-27B (its published config, no weights) on cluster.yaml's 8 x H200 node: each stage's memory per GPU
    (raypipe.sizing), the state files beside the object store in /dev/shm, the AMI. On cluster_separate.yaml's L40S
    service nodes one GPU per replica cannot hold the target: the row says so, with the fix."""
    from raypipe.assets.published import write_config_dir

    target = write_config_dir("Qwen/Qwen3.6-27B", tmp_path / "target")
    common = [
        f"serve.model={target}",
        "train.drafter.mask_token_id=151669",
        f"data.output={tmp_path}/prepared",
        f"train.output={tmp_path}/train",
    ]
    status, rows, out = doctor(*common, recipe="qwen36_27b", cluster="cluster.yaml")
    for row in ("GPU serve", "GPU train", "/dev/shm gpu", "AMI", "/dev/shm"):
        assert rows[row][0] == "PASS", out
    assert "(node type gpu, p5en.48xlarge)" in rows["GPU serve"][1] and "state files up to 3.52 GiB" in out, out

    one_gpu = ["serve.tensor_parallel_size=1", "serve.num_gpus=1"]
    status, rows, out = doctor(*common, *one_gpu, recipe="qwen36_27b", cluster="cluster_separate.yaml")
    assert status == 1 and rows["GPU serve"][0] == "FAIL", out
    assert "raise serve.tensor_parallel_size" in rows["GPU serve"][1] and rows["GPU train"][0] == "PASS", out
