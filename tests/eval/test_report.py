"""The report flags estimates that disagree with vLLM and draws labelled plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from raypipe.eval.offline import Replay
from raypipe.eval.report import compare, measurements, plot_acceptance, plot_training, training_estimate
from raypipe.eval.spec_decode import Generation, merge


def test_an_estimate_beyond_the_threshold_is_flagged() -> None:
    assert compare("offline_replay", 2.9, 2.6, 0.15) == {
        "estimate": "offline_replay",
        "temperature": 0.0,
        "tau": 2.9,
        "vllm_tau": 2.6,
        "relative_gap": abs(2.9 - 2.6) / 2.6,
        "flagged": False,
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


def _generation(temperature: float, replies: list[list[int]], accepted: int) -> Generation:
    return Generation(
        temperature,
        replies,
        seconds=1.0,
        drafts=10,
        draft_tokens=30,
        accepted_tokens=accepted,
        accepted_per_position=[accepted, 0, 0],
    )


def test_measurements_compare_the_estimates_with_vllm() -> None:
    steps = [{"step": 10 * i, "loss": 1.0 / i, "tau_estimate": 2.0} for i in range(1, 11)]
    trained = [_generation(0.0, [[1, 2]], 10), _generation(1.0, [[1, 3]], 5)]
    plain = [_generation(0.0, [[1, 2]], 0), _generation(1.0, [[1, 4]], 0)]
    offline = {0.0: Replay(10, 10, [10, 0, 0]), 1.0: Replay(10, 2, [2, 0, 0])}  # at 1.0: 20% below vLLM's 1.5
    doc = measurements(trained, None, plain, _generation(0.0, [[1, 2]], 0), offline, steps, 0.15)
    assert doc["tau"] == 2.0 and doc["tau_method"] == "vllm" and doc["vllm_refused_drafter"] is None
    assert [(c["estimate"], c["temperature"]) for c in doc["comparisons"]] == [
        ("offline_replay", 0.0),
        ("offline_replay", 1.0),
        ("training_estimate", 0.0),
    ]
    assert doc["comparisons"][1]["flagged"] and doc["disagreement"]  # the replay of vLLM's sampled replies disagrees
    assert doc["offline_replay_sampled"] == [{"temperature": 1.0, **offline[1.0].summary()}]
    assert doc["greedy_replies_match_without_drafter"] and doc["training"]["steps"] == 100


def test_a_drafter_vllm_refuses_is_reported_with_its_error_and_the_offline_replay_gives_tau() -> None:
    refused = (
        "NotImplementedError: Speculative Decoding with draft models or parallel drafting does not support M-RoPE yet"
    )
    plain = [_generation(0.0, [[1, 2]], 0)]
    doc = measurements([], refused, plain, None, {0.0: Replay(8, 4, [3, 1, 0])}, [], 0.15)
    assert doc["tau"] == 1.5 and doc["tau_method"] == "offline_replay" and doc["vllm_refused_drafter"] == refused
    assert doc["vllm"] == [] and doc["comparisons"] == [] and doc["vllm_untrained_drafter"] is None


def test_categories_are_merged_in_prompt_order_and_reported_with_their_speedup() -> None:
    groups = {"math": [0, 2], "chat": [1]}
    trained = merge(
        0.0,
        {"math": _generation(0.0, [[1], [3]], 8), "chat": _generation(0.0, [[2]], 2)},
        groups,
    )
    assert trained.replies == [[1], [2], [3]] and trained.drafts == 20 and trained.accepted_tokens == 10
    assert trained.accepted_per_position == [10, 0, 0] and trained.seconds == 2.0
    plain = merge(0.0, {"math": _generation(0.0, [[1], [3]], 0), "chat": _generation(0.0, [[2]], 0)}, groups)
    plain.categories["chat"]["tokens_per_s"] /= 2  # the drafter doubles chat's rate
    doc = measurements([trained], None, [plain], None, {0.0: Replay(20, 10, [10, 0, 0])}, [], 0.15)
    assert doc["tau_by_category"] == {"math": 1.8, "chat": 1.2}
    assert (
        doc["vllm"][0]["categories"]["chat"]["speedup"] == 2.0
        and doc["vllm"][0]["categories"]["math"]["speedup"] == 1.0
    )
