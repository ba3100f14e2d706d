"""Training metrics: summed on the training device, reduced across ranks once per logged interval.

The drafter returns sum/total pairs as 0-dim tensors on the device (loss,
accuracy per block position, estimated acceptance). Reading any of them on
the host waits for the GPU, so a step only adds them to a device vector;
every `train.run.log_every` steps (and at checkpoints) the vector, with the
host-side timings appended, is all-reduced on the device in one collective
and copied to the host once. Host floats never enter a collective: with
`cpu:gloo,cuda:nccl` a CPU tensor would take the gloo path.

Skipped steps (a non-finite loss or gradient norm, raypipe.train.step) add
nothing to the means; they are counted (`nonfinite_steps`), and the longest
run of consecutive skipped steps (`nonfinite_run`, carried across intervals)
lets the loop stop a run that no longer learns. Every rank skips the same
steps, so these two are read from the local rank, not reduced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raypipe.train.step import NONFINITE
from raypipe.train.tau_rule import TAU_PREFIX


class StepMetrics:
    """Sums of the drafter's metrics and the step timings since the last reduction."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[str] | None = None
        self.sums: torch.Tensor | None = None
        self.host: dict[str, float] = {}
        self.steps = 0
        self.nonfinite = torch.zeros((), dtype=torch.float64, device=device)  # skipped steps since the last reduction
        self.run = torch.zeros((), dtype=torch.float64, device=device)  # consecutive skipped steps up to the last one
        self.longest = torch.zeros((), dtype=torch.float64, device=device)  # longest such run since the last reduction

    def add(self, model_metrics: dict[str, torch.Tensor], **host: float) -> None:
        """One step: device tensors stay on the device (no host sync), host values are summed on the host.

        `model_metrics` is what train_step returns: the drafter's metrics and the skip flag (absent: the step
        trained)."""
        drafter = {k: v for k, v in model_metrics.items() if k != NONFINITE}
        if self.keys is None:
            self.keys = sorted(drafter)
        vec = torch.stack([drafter[k].detach() for k in self.keys]).double()  # the drafter's metrics are on the device
        if NONFINITE in model_metrics:
            skipped = model_metrics[NONFINITE].detach().double()
            vec = torch.where(
                skipped > 0, torch.zeros_like(vec), vec
            )  # a skipped step's metrics are NaN or meaningless
            self.nonfinite = self.nonfinite + skipped
            self.run = (self.run + 1) * skipped
            self.longest = torch.maximum(self.longest, self.run)
        self.sums = vec if self.sums is None else self.sums + vec
        for key, value in host.items():
            self.host[key] = self.host.get(key, 0.0) + value
        self.steps += 1

    def reduced_on_device(self) -> torch.Tensor:
        """The sums of every rank (a collective: every rank calls it at the same step), then this rank's skip counts
        (the same on every rank), still on the device."""
        assert self.sums is not None and self.keys is not None, "no step since the last reduction"
        host = torch.tensor([self.host[k] for k in sorted(self.host)], dtype=torch.float64, device=self.device)
        vec = torch.cat([self.sums, host])
        dist.all_reduce(vec)
        return torch.cat([vec, torch.stack([self.nonfinite, self.longest])])

    def reduce(self) -> dict[str, float]:
        """Means of the sum/total pairs (NaN when every step was skipped) and totals of the host values, over ranks and
        steps, with the skip counts; resets the sums."""
        assert self.keys is not None
        summed = dict(
            zip([*self.keys, *sorted(self.host), "nonfinite_steps", "nonfinite_run"], self.reduced_on_device().tolist())
        )
        totals = {k: summed[k[: -len("_sum")] + "_total"] for k in self.keys if k.endswith("_sum")}
        out = {k[: -len("_sum")]: summed[k] / totals[k] if totals[k] > 0 else float("nan") for k in totals}
        out["tau_estimate"] = out.pop("eal")
        for key in [k for k in out if k.startswith("position_") and k.endswith("_acc")]:
            out[f"acc_pos_{key.split('_')[1]}"] = out.pop(key)
        out.update({k: summed[k] for k in [*self.host, "nonfinite_steps", "nonfinite_run"]})
        out["steps"] = float(self.steps)
        self.sums, self.host, self.steps = None, {}, 0
        self.nonfinite, self.longest = torch.zeros_like(self.nonfinite), self.run.clone()
        return out


class TrainMetrics:
    """Prometheus metrics of the trainer (exported by Ray with a ray_ prefix), set from rank 0 at each log."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Gauge

        from raypipe.counters import counter

        tags = ("run",)
        self.tags = {"run": run}
        self.loss = Gauge("raypipe_train_loss", "Training loss, mean over the last logged interval.", tags)
        self.tau = Gauge(
            "raypipe_train_tau_estimate", "Acceptance length estimated from the last interval's draft accuracy.", tags
        )
        self.wait = Gauge(
            "raypipe_train_wait_fraction", "Share of the last interval spent waiting for hidden states.", tags
        )
        self.lr = Gauge("raypipe_train_lr", "Learning rate.", tags)
        self.tokens_per_s = Gauge("raypipe_train_tokens_per_s", "Tokens trained per second, all workers.", tags)
        # At 0 from the start (raypipe.counters): a healthy run's skipped steps read 0, not "no data".
        self.steps = counter("raypipe_train_steps", "Optimizer steps taken.", tags, [self.tags])
        self.nonfinite = counter(
            "raypipe_train_nonfinite_steps", "Steps skipped for a NaN or Inf loss or gradient norm.", tags, [self.tags]
        )
        self.accuracy = Gauge(
            "raypipe_train_accuracy", "Draft accuracy of the last interval by block position.", ("run", "position")
        )
        self.vllm_tau = Gauge(
            "raypipe_train_vllm_tau",
            "Acceptance length in vLLM during training (eval.every_steps), at each eval temperature.",
            ("run", "temperature"),
        )

    def record(self, m: dict[str, Any]) -> None:
        self.loss.set(m["loss"], self.tags)
        self.tau.set(m["tau_estimate"], self.tags)
        self.wait.set(m["wait_fraction"], self.tags)
        self.lr.set(m["lr"], self.tags)
        self.tokens_per_s.set(m["tokens_per_s"], self.tags)
        self.steps.inc(m["steps"], self.tags)
        if m["nonfinite_steps"]:
            self.nonfinite.inc(m["nonfinite_steps"], self.tags)
        for key, value in m.items():
            if key.startswith("acc_pos_"):
                self.accuracy.set(value, {**self.tags, "position": key[len("acc_pos_") :]})
            elif key.startswith(TAU_PREFIX):
                self.vllm_tau.set(value, {**self.tags, "temperature": key[len(TAU_PREFIX) :]})


def tracked(m: dict[str, Any]) -> dict[str, float]:
    """A logged interval as the experiment trackers get it (raypipe.train.trackers): the values the Prometheus metrics
    above are set to, named without their `raypipe_train_` prefix, accuracy by position as `accuracy/{position}`, τ
    in vLLM as `vllm_tau/t{temperature}`."""
    out = {k: float(m[k]) for k in ("loss", "tau_estimate", "wait_fraction", "lr", "tokens_per_s", "nonfinite_steps")}
    out.update({f"accuracy/{k[len('acc_pos_') :]}": float(v) for k, v in m.items() if k.startswith("acc_pos_")})
    out.update({f"vllm_tau/t{k[len(TAU_PREFIX) :]}": float(v) for k, v in m.items() if k.startswith(TAU_PREFIX)})
    return out
