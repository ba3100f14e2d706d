"""Ray wiring of the evaluation stage: vLLM's τ for the exported drafter, beside the estimates.

Before an engine loads the exported drafter, its process checks the serving
contract (raypipe.train.contract) with the vLLM it runs: a mismatch stops the
evaluation with the named fields (ContractError), since vLLM would serve a
drafter other than the one trained and the offline replay would measure the
trained one. A drafter vLLM itself refuses is reported instead
(`vllm_refused_drafter`) and τ comes from the offline replay.

The engines run one at a time in an actor with a Serve replica's resources
(`EngineHosts`), killed afterwards so that its memory is returned:
1. vLLM with the exported drafter at every `eval.temperatures`;
2. vLLM without a drafter (the tokens/s baseline);
3. vLLM with an untrained drafter of the same shape (the floor, τ about 1);
4. the offline replay of 1's replies at every temperature with the drafter
   outside vLLM (raypipe.eval.offline), on the target's reference states;
5. the latency sweep (raypipe.eval.latency): vLLM's OpenAI-compatible server
   with the drafter and without, at each `eval.concurrency`;
6. the K sweep: the server with the drafter at each num_speculative_tokens
   K = 1..block − 1 at each `eval.k_concurrency` (K = block − 1 taken from 5
   where the levels coincide). The K chosen (raypipe.eval.best_k) is written
   into the export's export.json and its vLLM command (`vllm_command` in
   eval.json too).
The training-time estimate comes from the run's ledger. `eval.json` and the
plots are written to `eval.output` (default {train.output}/eval).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from raypipe.compat.ray import metrics_report_interval_s
from raypipe.config import RaypipeConfig, ServeConfig
from raypipe.console import logger
from raypipe.eval.best_k import best_k_report, format_table
from raypipe.eval.offline import Replay, load_drafter, replay, step_seconds
from raypipe.eval.prompts import load_prompts
from raypipe.eval.report import (
    draft_vocab_summary,
    latency_table,
    measurements,
    plot_acceptance,
    plot_latency,
    plot_training,
)
from raypipe.eval.spec_decode import Generation, generate_in_vllm
from raypipe.layout import RunFolders, eval_output
from raypipe.serve.deployment import engine_process_options
from raypipe.storage import Storage
from raypipe.target import resolve_target
from raypipe.train.contract import ContractError
from raypipe.train.export import DONE, check_export
from raypipe.train.ledger import read_training_curve

TRAINED, UNTRAINED = "trained", "untrained"


def _export(cfg: RaypipeConfig) -> Storage:
    export = RunFolders.of(cfg).export
    if not export.exists(DONE):
        raise ValueError(f"no exported drafter at {export.url}: train, then `raypipe export` with this config")
    return export


def _local_copy(export: Storage, directory: str) -> str:
    """vLLM loads a local directory: copy the export's files (config, code, weights) into one."""
    for rel in export.glob("*"):
        Path(directory, rel).write_bytes(export.read(rel))
    return directory


def _generate(
    config: dict[str, Any],
    drafter: str | None,
    prompts: list[list[int]],
    groups: dict[str, list[int]] | None,
    temperatures: list[float],
) -> tuple[list[Generation], list[str]]:
    """One vLLM engine: with the exported drafter (its serving contract checked first), an untrained one of its shape,
    or none; and the fixes to vLLM's CPU kernels that its process installed (raypipe.compat.vllm_cpu_fixes)."""
    from raypipe.compat import vllm_cpu_fixes
    from raypipe.serve.vllm_args import engine_args
    from raypipe.train.drafter import build_drafter
    from raypipe.train.vocab import read_draft_vocab

    cfg = RaypipeConfig.model_validate(config)
    target = resolve_target(cfg.serve)
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if drafter == TRAINED:
            check_export(_export(cfg), target.path).require()
            path = _local_copy(_export(cfg), tmp)
        elif drafter == UNTRAINED:
            build_drafter(target, cfg.train, read_draft_vocab(cfg, target.shape.vocab_size)).save_pretrained(tmp)
            path = tmp
        runs = generate_in_vllm(
            engine_args(target, cfg.serve),
            path,
            cfg.train.drafter.block_size - 1,
            prompts,
            temperatures,
            max_tokens=cfg.eval.max_tokens,
            label=f"{drafter or 'no'} drafter",
            groups=groups,
        )
    return runs, list(vllm_cpu_fixes.APPLIED)


def _latency(
    config: dict[str, Any],
    drafter: str | None,
    prompts: list[list[int]],
    k: int | None = None,
    levels: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The latency sweep through vLLM's OpenAI-compatible server, with the exported drafter or without one; with the
    drafter at `k` drafted tokens (default block − 1), at `levels` (default eval.concurrency). The drafter's rows name
    their K (`num_speculative_tokens`)."""
    from raypipe.eval.latency import sweep
    from raypipe.serve.vllm_args import engine_args

    cfg = RaypipeConfig.model_validate(config)
    k = k or cfg.train.drafter.block_size - 1
    with tempfile.TemporaryDirectory() as tmp:
        speculative = None
        if drafter == TRAINED:
            speculative = {"method": "dflash", "model": _local_copy(_export(cfg), tmp), "num_speculative_tokens": k}
        rows = sweep(
            engine_args(resolve_target(cfg.serve), cfg.serve),
            speculative,
            prompts[: cfg.eval.latency_prompts],
            cfg.eval.concurrency if levels is None else levels,
            cfg.eval.max_tokens,
            drafter or "no",
        )
    return [{**r, "num_speculative_tokens": k} if speculative else r for r in rows]


def _k_sweep(
    cfg: RaypipeConfig, hosts: EngineHosts, config: dict[str, Any], prompts: list[list[int]], latency: list[dict]
) -> list[dict[str, Any]]:
    """The trained drafter's rows at every K = 1..block − 1 and level of eval.k_concurrency: K = block − 1 from the
    latency sweep where its levels coincide (measured once), the rest on a server per K."""
    last = cfg.train.drafter.block_size - 1
    levels = cfg.eval.k_concurrency
    reused = [r for r in latency if r["drafter"] == TRAINED and r["concurrency"] in levels]
    rows = list(reused)
    for k in range(1, last + 1):
        missing = levels if k < last else [c for c in levels if c not in {r["concurrency"] for r in reused}]
        if missing:
            logger("eval").info(f"TPOT of the trained drafter at K={k} (of {last}), concurrency {missing}")
            rows += hosts.call(_latency, config, TRAINED, prompts, k, missing)
    return rows


def _serve_best_k(cfg: RaypipeConfig, best: dict[str, Any], eval_json: str) -> str | None:
    """export.json rewritten with the chosen K (raypipe.eval.best_k.write_served_k); its new vllm_command, None where
    no K was chosen (export.json keeps block − 1)."""
    from raypipe.eval.best_k import write_served_k
    from raypipe.serve.vllm_args import engine_args, serve_command

    k = best["chosen"]
    if k is None:
        return None
    engine = engine_args(resolve_target(cfg.serve), cfg.serve)
    chosen_by = {
        "measurement": "the evaluation's K sweep (eval.json's best_k): mean TPOT through vLLM's OpenAI server, "
        "temperature 0",
        "eval": eval_json,
        "levels": best["levels"],
        "tpot_ms": {level: best["table"][level][str(k)]["tpot_ms"] for level in best["table"]},
        "best_per_level": best["best_per_level"],
        "worst_ratio_to_best": best["worst_ratio_to_best"][str(k)],
        "rule": best["rule"],
    }
    doc = write_served_k(_export(cfg), k, chosen_by, lambda speculative: serve_command(engine, speculative))
    return doc["vllm_command"]


def _offline(
    config: dict[str, Any], prompts: list[list[int]], replies: dict[float, list[list[int]]]
) -> tuple[dict[float, Replay], dict[str, Any] | None]:
    """The replay of vLLM's replies at each temperature with the exported drafter on the target's reference states
    (fp32, transformers); with a draft vocabulary, also what it costs and saves (report.draft_vocab_summary)."""
    import torch

    from raypipe.serve.hf_engine import TransformersEngine
    from raypipe.train.drafter import build_drafter
    from raypipe.train.vocab import read_draft_vocab

    cfg = RaypipeConfig.model_validate(config)
    target = resolve_target(cfg.serve)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = TransformersEngine(target.path, target.layer_ids, dtype="float32", device=device)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = read_draft_vocab(cfg, target.shape.vocab_size)
        drafter = load_drafter(build_drafter(target, cfg.train, vocab), _local_copy(_export(cfg), tmp)).to(device)
    replays = {t: replay(drafter, engine, prompts, r) for t, r in replies.items()}
    if vocab is None:
        return replays, None
    # The same drafter's step with the target's whole head (untrained: only its cost is read), on the first replies.
    whole_head = cfg.train.drafter.model_copy(update={"draft_vocab_size": None})
    full = build_drafter(target, cfg.train.model_copy(update={"drafter": whole_head}), None).eval().to(device)
    pairs = list(zip(prompts, replies[min(replies)], strict=True))[:8]
    inputs = [(p + r, engine.extract([p + r])[0], len(p)) for p, r in pairs]
    seconds = step_seconds({"draft_vocab": drafter, "full_vocab": full}, inputs)
    return replays, draft_vocab_summary(vocab.t2d.cpu().numpy(), replies, seconds)


class EngineHosts:
    """The processes the evaluation's engines run in, one engine at a time, each with a Serve replica's resources.

    On CPU one actor runs them all: an engine's memory returns when it is collected (the process's RSS stayed flat
    over five engines in a row, docs/benchmarks_log.md), and each later engine saves a Ray worker's start and vLLM's
    import.
    On GPUs each engine gets its own actor, since vLLM does not give a GPU's memory back in-process. An actor whose
    engine failed is replaced: a failed start may leave its process half set up. The engine core runs in the actor's
    process, so an engine that cannot start raises vLLM's own error here instead of "Engine core initialization
    failed"."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.options, self.shared, self.host = engine_process_options(cfg), not cfg.num_gpus, None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        host, self.host = self.host or _Host.options(**self.options).remote(), None
        try:
            result = ray.get(host.run.remote(fn, *args))
        except BaseException:
            ray.kill(host)
            raise
        if self.shared:
            self.host = host
        else:
            ray.kill(host)
        return result

    def close(self) -> None:
        if self.host is not None:
            ray.kill(self.host)
            self.host = None


@ray.remote
class _Host:
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def _record_metrics(
    run: str, trained: list[Generation], untrained: Generation | None, offline: dict[float, Replay]
) -> None:
    """The measured acceptance as Ray metrics (ray_raypipe_eval_*), beside the training ones on the dashboard."""
    from ray.util.metrics import Gauge

    tau = Gauge(
        "raypipe_eval_tau",
        "Acceptance length: vLLM-measured (drafter=trained|untrained) or the offline replay.",
        ("run", "drafter", "temperature", "method"),
    )
    speed = Gauge(
        "raypipe_eval_tokens_per_s",
        "Generated tokens per second in vLLM with the trained drafter.",
        ("run", "temperature"),
    )
    for g in trained:
        tau.set(g.tau, {"run": run, "drafter": "trained", "temperature": f"{g.temperature:g}", "method": "vllm"})
        speed.set(g.tokens_per_s, {"run": run, "temperature": f"{g.temperature:g}"})
    if untrained is not None:
        tau.set(untrained.tau, {"run": run, "drafter": "untrained", "temperature": "0", "method": "vllm"})
    for t, r in offline.items():
        tau.set(r.tau, {"run": run, "drafter": "trained", "temperature": f"{t:g}", "method": "offline_replay"})


def _refusal(err: Exception) -> str:
    """vLLM's own error, from the actor that started the engine (in-process engine core: the real exception)."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {cause}".splitlines()[0]


def run_evaluation(cfg: RaypipeConfig) -> dict[str, Any]:
    """Measure, compare, plot; returns eval.json's content (also written to eval.output)."""
    export = _export(cfg)
    sample_ids, prompts, groups = load_prompts(cfg)
    config = cfg.model_dump()
    temps = cfg.eval.temperatures
    hosts = EngineHosts(cfg.serve)
    try:
        logger("eval").info(f"1/4 vLLM with the trained drafter: {len(prompts)} prompts at temperatures {temps}")
        trained: list[Generation] = []
        refused, fixes = None, []
        try:
            trained, fixes = hosts.call(_generate, config, TRAINED, prompts, groups, temps)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ContractError):
                raise err.cause from None  # before the engine started: fail fast with the named mismatches
            refused = _refusal(err)
            logger("eval").info(
                f"vLLM refused the DFlash drafter with this target: {refused}; τ comes from the offline replay"
            )
        logger("eval").info("2/4 vLLM without a drafter (the tokens/s baseline)")
        plain, _ = hosts.call(_generate, config, None, prompts, groups, temps)
        untrained = None
        if refused is None:
            logger("eval").info("3/4 vLLM with an untrained drafter (the floor)")
            [untrained], _ = hosts.call(_generate, config, UNTRAINED, prompts, groups, [0.0])
        replies = {g.temperature: g.replies for g in trained} or {
            0.0: next(g for g in plain if g.temperature == 0).replies
        }
        logger("eval").info(f"4/4 offline replay of vLLM's replies at temperatures {sorted(replies)}")
        offline, draft_vocab = hosts.call(_offline, config, prompts, replies)

        latency: list[dict[str, Any]] = []
        if cfg.eval.concurrency:
            logger("eval").info(f"latency through vLLM's OpenAI server at concurrency {cfg.eval.concurrency}")
            for drafter in ([TRAINED] if refused is None else []) + [None]:
                latency += hosts.call(_latency, config, drafter, prompts)
        k_rows: list[dict[str, Any]] = []
        if cfg.eval.k_concurrency and refused is None:
            k_rows = _k_sweep(cfg, hosts, config, prompts, latency)
    finally:
        hosts.close()

    recorded = time.monotonic()
    _record_metrics(cfg.name, trained, untrained, offline)
    steps = read_training_curve(RunFolders.of(cfg).ledger)
    doc = {
        "run": cfg.name,
        "drafter": export.url,
        "target": cfg.serve.model,
        "prompts": {
            "source": cfg.eval.prompts,
            "count": len(prompts),
            "first_ids": sample_ids[:5],
            "categories": {name: len(positions) for name, positions in groups.items()} if groups else None,
            "max_tokens": cfg.eval.max_tokens,
        },
        "num_speculative_tokens": cfg.train.drafter.block_size - 1,
        "vllm_cpu_fixes": fixes,
        **measurements(trained, refused, plain, untrained, offline, steps, cfg.eval.threshold),
        "latency": latency_table(latency),
        "best_k": best_k_report(k_rows, cfg.train.drafter.block_size) if k_rows else None,
        "draft_vocab": draft_vocab,
    }
    out = eval_output(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        if steps:
            plot_training(steps, doc["tau"], Path(tmp, "training.png"))
        series = {f"vLLM, temperature {g.temperature:g}": g.summary()["acceptance_per_position"] for g in trained}
        for t, r in offline.items():
            series[f"offline replay, temperature {t:g}"] = r.summary()["acceptance_per_position"]
        if untrained is not None:
            series["vLLM, untrained drafter"] = untrained.summary()["acceptance_per_position"]
        plot_acceptance(series, Path(tmp, "acceptance.png"))
        if latency:
            plot_latency(latency, Path(tmp, "latency.png"))
        for name in sorted(p.name for p in Path(tmp).iterdir()):
            out.write(name, Path(tmp, name).read_bytes())
    doc["plots"] = [out.child(p).url for p in sorted(out.glob("*.png"))]
    doc["output"] = out.url
    doc["vllm_command"] = None
    if doc["best_k"] is not None:
        best = doc["best_k"]
        logger("eval").info(f"TPOT per K (num_speculative_tokens) and concurrency:\n{format_table(best)}")
        doc["vllm_command"] = _serve_best_k(cfg, best, out.child("eval.json").url)
        if doc["vllm_command"] is None:
            logger("eval").warning(f"no K had a TPOT measured: export.json keeps K={best['default']}")
        else:
            logger("eval").info(f"served K={best['chosen']} ({best['rule']}): export.json rewritten")
    out.write_json("eval.json", doc)
    for c in doc["comparisons"]:
        if c["flagged"]:
            logger("eval").warning(
                f"DISAGREEMENT: {c['estimate']} τ {c['tau']:.2f} vs vLLM {c['vllm_tau']:.2f} "
                f"({100 * c['relative_gap']:.0f}% > {100 * cfg.eval.threshold:.0f}%)"
            )
    _await_metrics_export(recorded)
    return doc


def _await_metrics_export(since: float) -> None:
    """Stay up until Ray has exported the metrics set at `since`: this process exports them periodically, and a gauge
    set by a process that exits before the next export never reaches the metrics endpoint (a job's driver ends right
    after the evaluation, so the dashboard missed τ). Costs at most one export interval (10 s by default) and a
    second."""
    interval_s = max(metrics_report_interval_s(), 1.0)  # Ray's own floor on the interval
    time.sleep(max(0.0, since + interval_s + 1 - time.monotonic()))
