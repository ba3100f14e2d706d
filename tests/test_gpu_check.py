"""bench/gpu_check.py, the GPU machine's one prepared check, runs in CI at CPU size so it cannot rot."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(*args: str) -> list[dict[str, Any]]:
    """The check's JSON lines on CPU."""
    out = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def assert_trained(report: dict[str, Any]) -> None:
    assert report["attention"] == "sdpa" and report["loss"] == "ce (eager)" and not report["compiled"]
    assert report["metric_reductions"] == 2 and all(math.isfinite(x) for x in report["loss_first_last"])
    assert report["timed_steps"] == 3 and report["tokens_per_s_per_gpu"] > 0 and report["model_tflops_per_step"] > 0
    data = report["data"]
    assert 0 < data["pack_tokens_min_median_max"][2] <= data["step_tokens"]
    assert 0 < data["anchors_min_median_max"][0] <= data["anchors_min_median_max"][2] <= data["max_pack_anchors"]


def test_the_gpu_check_runs_both_shapes_at_cpu_size(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.jsonl"
    reports = gpu_check("--out", str(out))
    assert [json.loads(line) for line in out.read_text().splitlines()] == reports
    assert [(r["shape"], r["strategy"], r["world_size"]) for r in reports] == [
        ("qwen3_8b", "ddp", 1),
        ("qwen36_27b", "fsdp2", 1),
    ]
    for report in reports:
        assert_trained(report)
        assert report["placeholders_for"] == [] and report["shm_to_pinned_gb_per_s"] > 0
    # Qwen3.6-27B's distinctive drafter: heads of 256 from a composite config, hidden / 256 heads, grouped KV.
    drafter = reports[1]["drafter"]
    assert drafter["multimodal_target"] and (drafter["head_dim"], drafter["heads"], drafter["kv_heads"]) == (256, 2, 1)
    assert len(drafter["layer_ids"]) == 6


def test_the_gpu_check_runs_fsdp2_over_two_ranks() -> None:
    [report] = gpu_check("--world-size", "2", "--shapes", "qwen36_27b")
    assert (report["world_size"], report["strategy"]) == (2, "fsdp2")
    assert_trained(report)


@pytest.mark.parametrize(
    ("world", "gpu_gib", "anchors"),
    # one L40S, one H100, two H100s, one H200 (torch's total memory): 1024 anchors fit one H100 since the drafter's
    # two heads became one tensor (raypipe.train.drafter.share_verifier_head)
    [(1, 44.99, 128), (1, 79.19, 1024), (2, 79.19, 1024), (1, 140.4, 1024)],
)
def test_qwen36_27b_takes_fewer_anchors_per_pack_where_the_gpu_is_too_small(
    world: int, gpu_gib: float, anchors: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    check = importlib.import_module("gpu_check")
    cfg, target = check.load_shape("qwen36_27b", True, world, tmp_path)
    estimate = check.fit_pack_anchors(cfg, target, int(gpu_gib * 2**30))
    assert cfg.train.objective.max_pack_anchors == anchors and estimate <= 0.8 * gpu_gib
