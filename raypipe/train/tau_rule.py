"""τ in vLLM during training as the run reads it: when it is measured, when it stops a run, how checkpoints rank.

Measurements (raypipe.eval.probe) run every `eval.every_steps` optimizer steps and at each checkpoint, so every
checkpoint has its τ: checkpoints are ranked by τ at temperature 0 (higher is better; export takes the highest, the
later one on a tie, raypipe.train.launcher). A drafter whose τ is still below `eval.min_tau` once it has been
measured `eval.patience` times stops the run: training improves a drafter that vLLM does not serve as trained,
which only a mismatch of the serving contract explains (a wrong layer, their order, the rotary layout), and every
further step is wasted.

The default `eval.min_tau` is the untrained drafter's τ (the floor) plus half the gain over it that the training
estimates at that step, and at least MARGIN: a drafter that vLLM serves as trained realises nearly all of the
estimated gain (the demo: 3.01 in vLLM against an estimate of about 3.1 at its first measurement), one served with
another rotary layout a quarter of it (the demo: 1.6-1.7 against 3.2-3.5), whatever the block size and the model.
Half of it leaves room for held-out prompts unlike the training data. A partial mismatch can realise more than half
(the demo with the target's layers in reverse order: 2.3-2.7 against 3.1-3.6): each measurement that trails the
estimate by more than eval.threshold is warned about, not stopped.
"""

from __future__ import annotations

MARGIN = 0.25  # eval.min_tau's default is at least this far above the untrained drafter's τ
SHARE = 0.5  # ... and this share of the gain over it that the training estimates
SCORE = "vllm_tau"  # the checkpoint metric ranked when τ is measured during training (temperature 0)
TAU_PREFIX = f"{SCORE}_t"  # a measurement's metric: the prefix and the temperature


class TauTooLow(ValueError):
    """τ in vLLM stayed below eval.min_tau: the run stops."""


def tau_key(temperature: float) -> str:
    """A measurement's name in the logged metrics, the ledger and the trackers."""
    return f"{TAU_PREFIX}{temperature:g}"


def due(step: int, every_steps: int | None, checkpoint: bool) -> bool:
    """Whether τ is measured after `step` (a checkpoint step is always measured when measuring is on)."""
    return every_steps is not None and (checkpoint or step % every_steps == 0)


def min_tau(configured: float | None, floor: float, estimate: float) -> float:
    """`eval.min_tau`, or the untrained drafter's τ (`floor`) + SHARE of the gain the training estimates (`estimate`:
    its τ estimate at the measured step), at least MARGIN."""
    return configured if configured is not None else floor + max(MARGIN, SHARE * (estimate - floor))


def check_tau(
    curve: list[tuple[int, float]], configured: float | None, patience: int, floor: float, estimate: float
) -> None:
    """Stop (TauTooLow) when the latest of the measurements so far (step, τ at temperature 0) is below eval.min_tau
    (`configured`, or its default from the `floor` and the training's own τ `estimate` at that step) and there have
    been at least `patience` of them."""
    limit = min_tau(configured, floor, estimate)
    if len(curve) < patience or curve[-1][1] >= limit:
        return
    step, tau = curve[-1]
    source = (
        "as set"
        if configured is not None
        else f"the untrained drafter's τ {floor:.2f} + half the gain the training estimates, at least {MARGIN}"
    )
    raise TauTooLow(
        f"τ in vLLM is {tau:.2f} at step {step}, after {len(curve)} measurements (eval.patience={patience}), below "
        f"eval.min_tau {limit:.2f} ({source}), while training estimates τ~{estimate:.2f}: vLLM does not serve this "
        "drafter as it is trained. Check the serving contract: "
        "the target layers the drafter reads (serve.layer_ids, in order), the rotary layout and the mask token "
        "(`raypipe check-drafter` on a checkpoint's drafter/ names a static mismatch). Nothing after the last "
        "checkpoint is kept; set eval.min_tau lower only if the drafter is known to start slowly"
    )


def trailing(tau: float, estimate: float, threshold: float) -> str | None:
    """A warning when τ in vLLM trails the training's own estimate by more than `threshold` (eval.threshold, the
    evaluation's disagreement flag): a partial mismatch, which a τ above eval.min_tau does not stop."""
    gap = (estimate - tau) / estimate if estimate > 0 else 0.0
    if gap <= threshold:
        return None
    return (
        f"τ in vLLM {tau:.2f} trails the training estimate τ~{estimate:.2f} by {100 * gap:.0f}% (> eval.threshold "
        f"{100 * threshold:.0f}%): vLLM may serve the drafter otherwise than it trains (the serving contract: layer "
        "order, rotary layout), or the eval prompts differ from the training data"
    )
