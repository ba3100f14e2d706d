"""The report flags estimates that disagree with vLLM and draws labelled plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from raypipe.eval.report import compare, plot_acceptance, plot_training, training_estimate


def test_an_estimate_beyond_the_threshold_is_flagged() -> None:
    assert compare("offline_replay", 2.9, 2.6, 0.15) == {
        "estimate": "offline_replay", "tau": 2.9, "vllm_tau": 2.6, "relative_gap": abs(2.9 - 2.6) / 2.6, "flagged": False,
    }
    assert compare("training_estimate", 3.1, 2.6, 0.15)["flagged"]
    assert compare("training_estimate", 2.1, 2.6, 0.15)["flagged"]


def test_the_training_estimate_averages_the_last_tenth_of_the_steps() -> None:
    steps = [{"step": i, "tau_estimate": 1.0 if i <= 90 else 3.0} for i in range(1, 101)]
    assert training_estimate(steps) == 3.0
    assert training_estimate(steps[:3]) == 1.0


def _ink(path: Path) -> float:
    """Share of pixels that are not background: a blank or failed plot has none."""
    pixels = np.asarray(Image.open(path).convert("L"))
    return float((pixels < 200).mean())


def test_the_plots_are_images_with_content(tmp_path: Path) -> None:
    steps = [{"step": i, "loss": 1.0 / i, "tau_estimate": 1 + 2 * (1 - 1 / i)} for i in range(1, 50)]
    plot_training(steps, 2.7, tmp_path / "training.png")
    plot_acceptance({"vLLM, temperature 0": [0.9, 0.7, 0.5], "untrained": [0.0, 0.0, 0.0]}, tmp_path / "acceptance.png")
    for name, size in (("training.png", (1210, 440)), ("acceptance.png", (880, 440))):
        image = Image.open(tmp_path / name)
        assert image.format == "PNG" and image.size == size
        assert _ink(tmp_path / name) > 0.01
