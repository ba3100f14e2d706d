"""`raypipe` command line: one subcommand per stage, each parse -> build -> run -> report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from raypipe.console import logger

if TYPE_CHECKING:
    from raypipe.config import RaypipeConfig

OVERRIDES_HELP = "key=value overrides of the recipe, e.g. data.output=/tmp/out data.max_length=4096"


def _connect_ray(args: argparse.Namespace, cfg: RaypipeConfig) -> None:
    """Attach to the cluster of `ray job submit` / RAY_ADDRESS / the last `ray start` here, else start a local one; a
    head that does not answer stops the command with the fix (raypipe.ray_head) rather than ray.init's minutes of
    retries. Unless --verbose, this process and every worker of the job send the libraries' logs to the run's log
    folder (raypipe.console)."""
    import ray

    from raypipe.compat.ray import current_cluster_file
    from raypipe.ray_head import check_head

    if not ray.is_initialized():
        check_head(os.environ, current_cluster_file())

    import ray.serve  # noqa: F401  its import adds a console handler of its own, which quiet_process quiets

    from raypipe.console import job_env, quiet_process
    from raypipe.layout import log_dir

    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # the dashboard's Train view shows the runs
    env = job_env(args.verbose, log_dir(cfg))
    os.environ.update(env)  # read here too
    logs = quiet_process("driver")
    if not ray.is_initialized():
        runtime_env = {"env_vars": env, "worker_process_setup_hook": "raypipe.console.quiet_worker"}
        ray.init(logging_level="INFO" if args.verbose else "WARNING", runtime_env=runtime_env)
    if logs is not None:
        logger(args.command).info(f"libraries' logs: {logs.parent} (--verbose prints them here)")


def _config(args: argparse.Namespace) -> RaypipeConfig:
    """The recipe with its overrides, validated, and checked once against this machine (raypipe.preflight): the
    actors and workers that receive it validate it again, purely."""
    from raypipe.config import load_config
    from raypipe.preflight import preflight

    return preflight(load_config(args.recipe, args.overrides))


def _details(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """A command's whole result document, with --verbose."""
    if args.verbose:
        print(json.dumps(doc, indent=1))


def cmd_prepare(args: argparse.Namespace) -> int:
    from raypipe.data.pipeline import run_prepare
    from raypipe.data.sources import check_sources

    cfg = _config(args)
    check_sources(cfg.data.sources, cfg.data.storage_options)
    _connect_ray(args, cfg)
    manifest = run_prepare(cfg.data)  # prints its summary line
    _details(args, {"output": cfg.data.output, **manifest["counts"], "rejects_by_code": manifest["rejects_by_code"]})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from raypipe.serve.deployment import run_service, run_state_files_peak

    cfg = _config(args)
    _connect_ray(args, cfg)
    logger("serve").info(
        f"hidden-state service on http://{cfg.serve.http_host}:{cfg.serve.http_port}/hidden_states "
        "(health, stats, canary)"
    )
    run_service(cfg.serve, blocking=True, state_files_peak=run_state_files_peak(cfg))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from raypipe.pipeline import replies_stage, train_stage
    from raypipe.train.export import export_drafter

    cfg = _config(args)
    _connect_ray(args, cfg)
    replies_stage(cfg)
    m = train_stage(cfg)
    doc = export_drafter(cfg)
    logger("train").info(f"done: step {m.step}, loss {m.loss:.4f}, τ~{m.tau_estimate:.2f} (the last interval)")
    _print_export(doc)
    _details(args, {"metrics": asdict(m), "export": doc["speculative_config"], "vllm_command": doc["vllm_command"]})
    return 0


def _print_export(doc: dict[str, Any]) -> None:
    drafter = doc["speculative_config"]["model"]
    checks = sum(len(item) for item in doc["contract"]["items"].values())
    logger("export").info(f"drafter:  {drafter}")
    logger("export").info(
        f"contract: {checks} checks of what it trained with against what vLLM will apply pass "
        f"(export.json); before serving elsewhere: raypipe check-drafter {drafter}"
    )
    logger("export").info(f"serve it: {doc['vllm_command']}")


def cmd_export(args: argparse.Namespace) -> int:
    from raypipe.train.export import export_drafter

    cfg = _config(args)
    doc = export_drafter(cfg, args.output)
    _print_export(doc)
    _details(args, doc)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from raypipe.eval.evaluate import run_evaluation

    cfg = _config(args)
    _connect_ray(args, cfg)
    doc = run_evaluation(cfg)
    for g in doc["vllm"]:
        logger("eval").info(
            f"temperature {g['temperature']:g}: τ {g['tau']:.2f}, "
            f"acceptance by position {[round(r, 3) for r in g['acceptance_per_position']]}, "
            f"{g['tokens_per_s']:.0f} tokens/s ({g['speedup']:.2f}x without the drafter)"
        )
    logger("eval").info(
        f"untrained drafter τ {doc['vllm_untrained_drafter']['tau']:.2f}; "
        f"offline replay τ {doc['offline_replay']['tau']:.2f}; "
        f"training estimate τ {doc['training']['tau_estimate'] or float('nan'):.2f}"
    )
    logger("eval").info(f"report: {doc['output']}/eval.json, plots: {', '.join(doc['plots'])}")
    if doc["vllm_command"]:
        best = doc["best_k"]
        by_level = ", ".join(f"{k} at concurrency {level}" for level, k in best["best_per_level"].items())
        logger("eval").info(f"best K: {by_level}; served K={best['chosen']} (export.json rewritten)")
        logger("eval").info(f"serve it: {doc['vllm_command']}")
    return 0


def cmd_pipeline(args: argparse.Namespace) -> int:
    from raypipe.data.sources import check_sources
    from raypipe.pipeline import run_pipeline

    cfg = _config(args)
    check_sources(cfg.data.sources, cfg.data.storage_options)
    _connect_ray(args, cfg)
    done = run_pipeline(cfg)
    ev, tr, ex = done["eval"], done["train"], done["export"]
    where = (
        "in vLLM (temperature 0)"
        if ev.tau_method == "vllm"
        else "from the offline replay: vLLM refused the drafter, see eval.json"
    )
    logger("pipeline").info(
        f"{cfg.name}: τ {ev.tau:.2f} {where} after {tr.step} steps"
        + (" — an estimate DISAGREES with vLLM, see eval.json" if ev.disagreement else "")
    )
    logger("pipeline").info(f"drafter:   {ex.drafter}")
    logger("pipeline").info(f"eval.json: {ev.output}/eval.json")
    logger("pipeline").info(f"plots:     {', '.join(ev.plots)}")
    logger("pipeline").info(f"serve it:  {ev.vllm_command or ex.vllm_command}")
    return 0


def cmd_check_drafter(args: argparse.Namespace) -> int:
    from raypipe.storage import Storage, absolute
    from raypipe.train.export import check_export

    contract = check_export(Storage(absolute(args.directory), {}), args.target)
    print(f"raypipe check-drafter: {contract.drafter} with target {contract.target}\n{contract.table()}")
    return int(not contract.ok)


def cmd_doctor(args: argparse.Namespace) -> int:
    from raypipe.doctor import run_doctor

    return run_doctor(args.recipe, args.overrides, args.cluster)


def build_parser() -> argparse.ArgumentParser:
    from raypipe.config import RECIPES_DIR
    from raypipe.console import verbose

    parser = argparse.ArgumentParser(prog="raypipe", description="Train DFlash drafters for chat models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    recipe_commands = [
        ("prepare", "Prepare datasets into token rows with assistant masks (Ray Data).", cmd_prepare),
        ("serve", "Run the hidden-state service (Ray Serve + vLLM) until stopped.", cmd_serve),
        ("train", "Train the DFlash drafter on Ray Train, fed by the service; exports it at the end.", cmd_train),
        ("export", "Write the latest checkpoint's drafter as a directory vLLM loads (dflash).", cmd_export),
        (
            "eval",
            "Measure the exported drafter's acceptance in vLLM beside the offline and training estimates.",
            cmd_eval,
        ),
        (
            "pipeline",
            "Prepare, serve, train, export and evaluate in one job; a re-run skips finished stages.",
            cmd_pipeline,
        ),
    ]
    recipe_names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    for name, help_text, func in recipe_commands:
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--recipe", required=True, help=f"Recipe name ({', '.join(recipe_names)}) or a YAML file.")
        if name == "export":
            command.add_argument(
                "--output", default=None, help="Export directory or URL; default: {train.output}/drafter/{name}."
            )
        command.add_argument(
            "--verbose",
            action="store_true",
            default=verbose(),
            help="Also print Ray's, Ray Train's and vLLM's own logs, and full result documents (or RAYPIPE_VERBOSE=1).",
        )
        command.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
        command.set_defaults(func=func)

    check = sub.add_parser(
        "check-drafter",
        help="Check an exported drafter against what vLLM will apply with its target (rotary, M-RoPE keys, mask "
        "token, target layers, non-causal draft blocks, hidden size, draft vocabulary) before `vllm serve`: a "
        "pass/fail table, each mismatch with its fix; exit status 1 on a mismatch.",
    )
    check.add_argument("directory", help="The drafter directory ({train.output}/drafter/{name}), local or a URL.")
    check.add_argument(
        "--target",
        default=None,
        help="The target: a directory, Hugging Face id or builtin name; default: the one the export.json names.",
    )
    check.set_defaults(func=cmd_check_drafter)

    doctor = sub.add_parser(
        "doctor", help="Check what a run of the recipe needs on this machine: a pass/fail table, each failure's fix."
    )
    doctor.add_argument("--recipe", default="demo", help="Recipe name or YAML file (default: demo).")
    doctor.add_argument(
        "--cluster",
        help="A Ray cluster file (cluster.yaml): the recipe's GPU memory, /dev/shm and AMI against its node types.",
    )
    doctor.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"raypipe {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
