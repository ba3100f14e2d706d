"""τ in vLLM during training: one engine with the target and a drafter of the run's shape, kept warm.

The training launcher starts the probe once per run (`start_probe`), before the workers, as a named actor; rank 0
of the trainers finds it by the run's name (`find_probe`). The engine starts with an untrained drafter of the run's
shape: its τ at each temperature is the floor that `eval.min_tau` defaults above (raypipe.train.tau_rule). Each
measurement then reloads the current drafter's trainable weights in place (raypipe.compat.vllm.reload_drafter:
milliseconds on the demo, where a new engine takes seconds, and minutes at 27B) and generates the first
`eval.probe_prompts` eval prompts at every `eval.temperatures`, read through vLLM's own acceptance counters
(raypipe.eval.spec_decode), as the evaluation after training does.

Where it runs: a Serve replica's resources (`serve.num_cpus`, `serve.resource`) with `eval.probe_gpus` GPUs
(default `serve.num_gpus`: a GPU of its own on the Serve node type). A fraction time-shares a GPU with the
hidden-state service: the probe's engine then takes that fraction of the GPU's memory, and serve's engines must
leave it free (serve.gpu_memory_utilization). On CPU it runs beside the trainers.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from raypipe.config import RaypipeConfig
from raypipe.console import logger

PROBE = "raypipe-tau-probe"


def probe_name(run: str) -> str:
    return f"{PROBE}-{run}"


class TauProbe:
    """The warm engine: built with an untrained drafter, measured once (`floor`), then reloaded per measurement."""

    def __init__(self, config: dict[str, Any], prompts: list[list[int]]) -> None:
        from vllm import LLM

        from raypipe.serve.reaper import engine_processes
        from raypipe.serve.vllm_args import engine_args
        from raypipe.target import resolve_target
        from raypipe.train.drafter import build_drafter
        from raypipe.train.vocab import read_draft_vocab

        cfg = RaypipeConfig.model_validate(config)
        target = resolve_target(cfg.serve)
        self.prompts = prompts
        self.temperatures, self.max_tokens = cfg.eval.temperatures, cfg.eval.max_tokens
        self.directory = tempfile.mkdtemp(prefix="raypipe-probe-")
        build_drafter(target, cfg.train, read_draft_vocab(cfg, target.shape.vocab_size)).save_pretrained(self.directory)
        engine = engine_args(target, cfg.serve)
        if cfg.eval.probe_gpus is not None and 0 < cfg.eval.probe_gpus < 1 and "gpu_memory_utilization" in engine:
            engine["gpu_memory_utilization"] = cfg.eval.probe_gpus  # its share of a GPU time-shared with Serve
        speculative = {
            "method": "dflash",
            "model": self.directory,
            "num_speculative_tokens": cfg.train.drafter.block_size - 1,
        }
        start = time.perf_counter()
        with engine_processes() as self.processes:
            self.llm = LLM(**engine, speculative_config=speculative)
        self.start_s = time.perf_counter() - start
        self.floor = self._generate()

    def _generate(self) -> dict[str, float]:
        """τ at each temperature (keys: the temperature as text)."""
        from raypipe.eval.spec_decode import generate_once

        return {
            f"{t:g}": generate_once(self.llm, self.prompts, t, self.max_tokens, "τ during training").tau
            for t in self.temperatures
        }

    def started(self) -> dict[str, Any]:
        """The untrained drafter's measurement and the engine's start time, in seconds."""
        return {"floor": self.floor, "start_s": self.start_s}

    def measure(self, weights: bytes) -> dict[str, float]:
        """Reload the drafter's trainable weights (a safetensors file's bytes, exported names) and measure τ at each
        temperature."""
        from raypipe.compat.vllm import reload_drafter

        self.llm.collective_rpc(reload_drafter, args=(weights,))
        return self._generate()

    def close(self) -> None:
        self.processes.reap()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_probe(cfg: RaypipeConfig) -> Any:
    """The run's probe actor, started and measured once (the untrained floor) before training begins; a probe that
    cannot start fails here with vLLM's error, not in a trainer."""
    import ray

    from raypipe.eval.prompts import load_prompts
    from raypipe.serve.deployment import engine_process_options

    serve = cfg.serve
    if cfg.eval.probe_gpus is not None:
        serve = serve.model_copy(update={"num_gpus": cfg.eval.probe_gpus})
    actor = (
        ray.remote(TauProbe)
        .options(name=probe_name(cfg.name), max_restarts=0, **engine_process_options(serve))
        .remote(cfg.model_dump(), load_prompts(cfg)[1][: cfg.eval.probe_prompts])  # read where the config was given
    )
    started = ray.get(actor.started.remote())
    floor = ", ".join(f"{tau:.2f} at T={t}" for t, tau in started["floor"].items())
    logger("train").info(
        f"τ in vLLM every {cfg.eval.every_steps} steps and at each checkpoint: engine started in "
        f"{started['start_s']:.1f} s; the untrained drafter's τ {floor}"
    )
    return actor


def stop_probe(actor: Any) -> None:
    import ray

    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)


def find_probe(run: str) -> Any:
    import ray

    return ray.get_actor(probe_name(run))
