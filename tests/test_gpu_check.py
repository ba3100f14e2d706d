"""bench/gpu_check.py, the GPU machine's one prepared check, runs in CI at toy size on CPU so it cannot rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_its_cpu_tiny_mode() -> None:
    out = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert [r["strategy"] for r in report["runs"]] == ["ddp", "fsdp2"] and report["placeholders_for"] == []
    assert report["shm_to_pinned_gb_per_s"] > 0
    for run in report["runs"]:
        assert run["attention"] == "sdpa" and run["loss"] == "ce (eager)"
        assert run["metric_reductions"] == 2 and all(math.isfinite(x) for x in run["loss_first_last"])
        assert run["tokens_per_s"] > 0 and run["model_tflops_per_step"] > 0
