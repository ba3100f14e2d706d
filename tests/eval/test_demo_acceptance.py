"""The demo recipe end to end: a drafter that vLLM really accepts, measured beside the estimates.

Prepare (Ray Data) -> service (Ray Serve, vLLM CPU) -> train (Ray Train, 2 workers) -> export
-> evaluate (vLLM with and without drafters, offline replay), on the bundled demo data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from ray import serve

from raypipe.config import load_config
from raypipe.data.pipeline import run_prepare
from raypipe.eval.evaluate import run_evaluation
from raypipe.serve.deployment import APP_NAME, ensure_service
from raypipe.train.export import export_drafter
from raypipe.train.launcher import run_training

pytestmark = pytest.mark.integration


def test_the_demo_drafter_reaches_tau_2_5_in_vllm_and_the_offline_replay_agrees(ray_cluster: str, demo_target: str, tmp_path: Path) -> None:
    cfg = load_config("demo", [f"data.output={tmp_path}/prepared", f"train.output={tmp_path}/train", f"train.cache={tmp_path}/cache"])
    run_prepare(cfg.data)
    ensure_service(cfg.serve)
    try:
        assert run_training(cfg).error is None
    finally:
        serve.delete(APP_NAME)  # free the cores for the evaluation's engines
    export_drafter(cfg)
    doc = run_evaluation(cfg)
    print(json.dumps({k: doc[k] for k in ("tau", "comparisons", "vllm_untrained_drafter")}, indent=1))

    greedy = doc["vllm"][0]
    assert greedy["temperature"] == 0.0 and greedy["tau"] >= 2.5
    assert doc["num_speculative_tokens"] == 3 and len(greedy["accepted_per_position"]) == 3
    assert doc["vllm_untrained_drafter"]["tau"] < 1.2  # the same prompts with an untrained drafter: about 1
    assert doc["greedy_replies_match_without_drafter"]  # speculative decoding stays lossless
    [offline] = [c for c in doc["comparisons"] if c["estimate"] == "offline_replay"]
    assert offline["relative_gap"] < 0.15 and not offline["flagged"]
    assert doc["offline_replay"]["steps"] == greedy["drafts"]  # the replay walks vLLM's own verification steps
    assert {g["temperature"] for g in doc["vllm"]} == {0.0, 1.0} and all(g["tokens_per_s"] > 0 for g in doc["vllm_without_drafter"])

    saved = json.loads(Path(doc["output"], "eval.json").read_text())
    assert saved["tau"] == doc["tau"]
    for plot in doc["plots"]:
        pixels = np.asarray(Image.open(plot).convert("L"))
        assert pixels.shape[0] > 300 and (pixels < 200).mean() > 0.01  # a drawn figure, not an empty canvas
