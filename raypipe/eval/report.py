"""The evaluation report: estimates set against vLLM's τ, and the plots (pure; no Ray, no engine).

vLLM's greedy τ is the reference. Each estimate (the offline replay on the same
prompts, the training-time estimate at the end of training) is compared with
it by relative gap, and flagged above the threshold: peers' estimates of one
checkpoint have been seen to differ by 70 %, so a silent estimate is not enough.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

from raypipe.train.tau_rule import TAU_PREFIX  # noqa: E402

if TYPE_CHECKING:
    from raypipe.eval.offline import Replay
    from raypipe.eval.spec_decode import Generation


def compare(name: str, estimate: float, vllm_tau: float, threshold: float, temperature: float = 0.0) -> dict[str, Any]:
    """An estimate next to vLLM's τ at a temperature: relative gap, and whether it exceeds the threshold."""
    gap = abs(estimate - vllm_tau) / vllm_tau
    return {
        "estimate": name,
        "temperature": temperature,
        "tau": estimate,
        "vllm_tau": vllm_tau,
        "relative_gap": gap,
        "flagged": gap > threshold,
    }


def training_estimate(steps: list[dict[str, float]], share: float = 0.1) -> float:
    """Mean training-time τ estimate over the last `share` of the steps (single steps are noisy)."""
    tail = steps[-max(1, round(len(steps) * share)) :]
    return sum(s["tau_estimate"] for s in tail) / len(tail)


def _with_speedup(g: Generation, without: Generation) -> dict[str, Any]:
    """A generation's summary with its tokens/s over the drafter-less engine's, overall and per category."""
    doc = {**g.summary(), "speedup": g.tokens_per_s / without.tokens_per_s}
    for name, part in doc["categories"].items():
        part["speedup"] = part["tokens_per_s"] / without.categories[name]["tokens_per_s"]
    return doc


def measurements(
    trained: list[Generation],
    refused: str | None,
    plain: list[Generation],
    untrained: Generation | None,
    offline: dict[float, Replay],
    steps: list[dict[str, float]],
    threshold: float,
) -> dict[str, Any]:
    """The measured part of eval.json: τ, each engine's counters, and the estimates set against vLLM.

    `offline` holds the replay of vLLM's replies at each temperature (raypipe.eval.offline): at temperature 0 it is
    the greedy estimate; above it, it replays vLLM's rejection sampling on the tokens vLLM sampled, so it must agree
    with vLLM's τ at that temperature as closely as at 0.

    When vLLM refused to run the drafter with this target (`refused`: its
    error), τ is the offline replay's, on the greedy replies of vLLM without a
    drafter, and nothing is compared with vLLM.
    """
    baseline = {g.temperature: g for g in plain}
    doc: dict[str, Any] = {
        "tau": offline[0.0].tau,
        "tau_method": "offline_replay",
        "vllm_refused_drafter": refused,
        "vllm": [],
        "vllm_without_drafter": [g.summary() for g in plain],
        "vllm_untrained_drafter": untrained.summary() if untrained else None,
        "offline_replay": offline[0.0].summary(),
        "offline_replay_sampled": [{"temperature": t, **r.summary()} for t, r in offline.items() if t > 0],
        "training": {
            "steps": steps[-1]["step"] if steps else 0,
            "final_loss": steps[-1]["loss"] if steps else None,
            "tau_estimate": training_estimate(steps) if steps else None,
        },
        "comparisons": [],
        "disagreement": False,
        "greedy_replies_match_without_drafter": None,
        "tau_by_category": None,
    }
    if refused is not None:
        return doc
    [greedy] = [g for g in trained if g.temperature == 0.0]
    comparisons = [compare("offline_replay", offline[0.0].tau, greedy.tau, threshold)]
    comparisons += [
        compare("offline_replay", offline[g.temperature].tau, g.tau, threshold, g.temperature)
        for g in trained
        if g.temperature > 0 and g.temperature in offline
    ]
    if steps:
        comparisons.append(compare("training_estimate", training_estimate(steps), greedy.tau, threshold))
    doc.update(
        tau=greedy.tau,
        tau_method="vllm",
        vllm=[_with_speedup(g, baseline[g.temperature]) for g in trained],
        tau_by_category={name: part["tau"] for name, part in greedy.categories.items()} or None,
        comparisons=comparisons,
        disagreement=any(c["flagged"] for c in comparisons),
        greedy_replies_match_without_drafter=greedy.replies == baseline[0.0].replies,
    )
    return doc


def plot_training(steps: list[dict[str, float]], vllm_tau: float, path: Path) -> None:
    """Loss and estimated τ against the step, τ in vLLM measured during training (eval.every_steps) where it was,
    and vLLM's greedy τ after training as a reference line."""
    x = [s["step"] for s in steps]
    fig, (loss_ax, tau_ax) = plt.subplots(1, 2, figsize=(11, 4))
    loss_ax.plot(x, [s["loss"] for s in steps], color="tab:blue")
    loss_ax.set(title="Training loss", xlabel="optimizer step", ylabel="loss (KL to the target)")
    loss_ax.set_yscale("log")
    tau_ax.plot(x, [s["tau_estimate"] for s in steps], color="tab:orange", label="training estimate (random anchors)")
    for key in sorted({k for s in steps for k in s if k.startswith(TAU_PREFIX)}):
        measured = [(s["step"], s[key]) for s in steps if key in s]
        tau_ax.plot(*zip(*measured), marker="o", label=f"vLLM during training, temperature {key[len(TAU_PREFIX) :]}")
    tau_ax.axhline(vllm_tau, color="tab:green", linestyle="--", label=f"vLLM measured, temperature 0 ({vllm_tau:.2f})")
    tau_ax.set(title="Acceptance length τ", xlabel="optimizer step", ylabel="τ (tokens per verification step)")
    tau_ax.legend(loc="lower right")
    for ax in (loss_ax, tau_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(series: dict[str, list[float]], path: Path) -> None:
    """Share of verification steps that accepted the draft at each position, one bar group per position."""
    width = max(len(v) for v in series.values())
    fig, ax = plt.subplots(figsize=(8, 4))
    bar = 0.8 / len(series)
    for i, (label, rates) in enumerate(series.items()):
        ax.bar([p + 1 + (i - (len(series) - 1) / 2) * bar for p in range(len(rates))], rates, width=bar, label=label)
    ax.set(
        title="Acceptance by draft position",
        xlabel="draft position (1 = first drafted token)",
        ylabel="accepted / verification steps",
        ylim=(0, 1.05),
    )
    ax.set_xticks(range(1, width + 1))
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draft_vocab_summary(
    kept: np.ndarray, replies: dict[float, list[list[int]]], seconds: dict[str, float]
) -> dict[str, Any]:
    """eval.json's `draft_vocab`: its size; the share of vLLM's reply tokens it holds at each temperature (a token
    outside it is never drafted, so the share bounds acceptance); the drafter's step time with it and with the
    target's whole vocabulary (`seconds` from raypipe.eval.offline.step_seconds). `kept` is t2d: bool per token."""
    shares = []
    for temperature, rs in sorted(replies.items()):
        tokens = np.fromiter((t for r in rs for t in r), np.int64)
        shares.append({"temperature": temperature, "share": float(kept[tokens].mean()) if tokens.size else None})
    return {
        "size": int(kept.sum()),
        "target_vocab_size": int(kept.size),
        "reply_tokens_in_vocab": shares,
        "drafter_step_ms": {name: 1000 * s for name, s in seconds.items()},
        "full_over_draft": seconds["full_vocab"] / seconds["draft_vocab"],
    }


def latency_table(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """eval.json's latency sweep: a row per (drafter, concurrency), and the drafter's speed-up per level (TPOT
    without over TPOT with, and tokens/s with over without); None when the sweep was skipped."""
    if not rows:
        return None
    by = {(r["drafter"], r["concurrency"]): r for r in rows}
    speedup = [
        {
            "concurrency": c,
            "tpot": by["no", c]["tpot_ms"]["mean"] / by[d, c]["tpot_ms"]["mean"],
            "tokens_per_s": by[d, c]["tokens_per_s"] / by["no", c]["tokens_per_s"],
            "tau": by[d, c]["tau"],
        }
        for d, c in by
        if d != "no" and ("no", c) in by and by[d, c]["tpot_ms"] and by["no", c]["tpot_ms"]
    ]
    return {"rows": rows, "speedup": speedup}


def plot_latency(rows: list[dict[str, Any]], path: Path) -> None:
    """TPOT and tokens/s against concurrency, with and without the drafter; τ beside the drafter's points."""
    fig, (tpot_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        mine = [r for r in rows if r["drafter"] == drafter and r["tpot_ms"]]
        x = [r["concurrency"] for r in mine]
        label = "without a drafter" if drafter == "no" else f"{drafter} drafter"
        tpot_ax.plot(x, [r["tpot_ms"]["mean"] for r in mine], marker="o", label=label)
        rate_ax.plot(x, [r["tokens_per_s"] for r in mine], marker="o", label=label)
        for r in mine:
            if r["tau"] is not None:
                tpot_ax.annotate(f"τ {r['tau']:.2f}", (r["concurrency"], r["tpot_ms"]["mean"]), fontsize=8)
    tpot_ax.set(title="Time per output token", xlabel="concurrent requests", ylabel="TPOT, mean (ms)")
    rate_ax.set(title="Throughput", xlabel="concurrent requests", ylabel="generated tokens / s")
    for ax in (tpot_ax, rate_ax):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
