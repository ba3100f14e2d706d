"""τ in vLLM during training as the run reads it (pure: no Ray, no engine): when it is measured, when it stops a run,
how checkpoints rank, the curve export.json records and training.png draws."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypipe.config import load_config
from raypipe.eval.report import plot_training
from raypipe.storage import Storage
from raypipe.train.export import tau_curve
from raypipe.train.launcher import checkpoint_score
from raypipe.train.ledger import Ledger
from raypipe.train.tau_rule import MARGIN, TauTooLow, check_tau, due, min_tau, tau_key, trailing


def test_measured_every_n_steps_and_at_every_checkpoint_only_when_set() -> None:
    assert [s for s in range(1, 13) if due(s, 5, checkpoint=s == 7)] == [5, 7, 10]
    assert not any(due(s, None, checkpoint=True) for s in range(1, 13))


def test_min_tau_defaults_to_half_the_estimated_gain_over_the_untrained_drafter() -> None:
    assert min_tau(None, 1.03, 3.53) == pytest.approx(1.03 + (3.53 - 1.03) / 2)
    assert min_tau(None, 1.03, 1.2) == pytest.approx(1.03 + MARGIN)  # early on, at least the margin
    assert min_tau(2.0, 1.03, 3.53) == 2.0


def test_a_low_tau_stops_the_run_only_after_patience_measurements_naming_the_serving_contract() -> None:
    # The demo's drafter trained with another rotary layout: τ 1.7 in vLLM while training estimates 3.5.
    low = [(197, 1.74), (250, 1.63), (394, 1.74)]
    check_tau(low[:2], None, patience=3, floor=1.03, estimate=3.5)  # two measurements: patience not spent
    with pytest.raises(TauTooLow) as err:
        check_tau(low, None, patience=3, floor=1.03, estimate=3.5)
    message = str(err.value)
    for part in (
        "1.74 at step 394",
        "after 3 measurements",
        "eval.min_tau 2.26 (the untrained drafter's τ 1.03 + half the gain",
        "τ~3.50",
        "serving contract",
        "serve.layer_ids",
        "raypipe check-drafter",
    ):
        assert part in message, (part, message)
    # Served as trained (the demo: 3.01 at the first measurement, the estimate about 3.1), or a partial mismatch that
    # realises more than half the gain (its layers in reverse order: 2.63 against 3.47): the run goes on.
    check_tau([*low[:2], (394, 3.01)], None, patience=3, floor=1.03, estimate=3.1)
    check_tau([*low[:2], (394, 2.63)], None, patience=3, floor=1.03, estimate=3.47)
    with pytest.raises(TauTooLow, match=r"below eval\.min_tau 3\.00 \(as set\)"):
        check_tau([*low[:2], (394, 2.63)], 3.0, patience=3, floor=1.03, estimate=3.47)


def test_checkpoints_rank_by_tau_in_vllm_when_it_is_measured_else_by_loss() -> None:
    assert checkpoint_score(load_config("demo", ["eval.every_steps=null"])) == ("train_loss", "min")
    assert checkpoint_score(load_config("demo", ["eval.every_steps=100"])) == ("vllm_tau", "max")


def test_the_tau_curve_comes_from_the_ledger_and_is_drawn_beside_the_estimate(tmp_path: Path) -> None:
    ledger = Storage(str(tmp_path / "ledger"), {})
    rank0 = Ledger(ledger, 0)
    curve = []
    for step in range(10, 101, 10):
        m = {"step": step, "loss": 1.0 / step, "tau_estimate": 1 + step / 50}
        if step % 50 == 0:
            m.update({tau_key(0.0): 1 + step / 60, tau_key(1.0): 1 + step / 70})
            curve.append({"step": step, "tau": {"0": 1 + step / 60, "1": 1 + step / 70}})
        rank0.add(0, step, [f"s{step}"])
        rank0.log(m)
    rank0.flush(101)
    assert tau_curve(ledger) == curve
    plot_training(
        [s for seg in [ledger.read_json(r) for r in ledger.glob("epoch-*/*.json")] for s in seg["steps"]],
        2.5,
        tmp_path / "training.png",
    )
    assert (tmp_path / "training.png").stat().st_size > 10_000


def test_what_tau_during_training_measures_joins_the_training_fingerprint_and_nothing_else_does() -> None:
    from raypipe.pipeline import train_fingerprint

    def of(*overrides: str) -> str:
        return train_fingerprint(load_config("demo", list(overrides)), "manifest", "target")

    off, on = of("eval.every_steps=null"), of()
    assert off != on and on != of("eval.every_steps=100") and on != of("eval.min_tau=2") and on != of("eval.patience=1")
    assert on != of("eval.probe_prompts=8")
    # The prompts past those it measures, and the evaluation's own settings, re-run no training.
    assert on == of("eval.num_prompts=99") == of("eval.concurrency=[1]") == of("eval.threshold=0.3")
    assert off == of("eval.every_steps=null", "eval.min_tau=2")


def test_tau_in_vllm_trailing_the_training_estimate_is_warned_about_not_stopped() -> None:
    assert trailing(3.42, 3.44, 0.15) is None and trailing(3.7, 3.5, 0.15) is None
    warning = trailing(2.63, 3.47, 0.15)
    assert warning is not None and "trails the training estimate τ~3.47 by 24% (> eval.threshold 15%)" in warning
