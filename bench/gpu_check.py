"""The one prepared GPU check: raypipe's drafter, train step, device feeder and metric reduction on one GPU.

    bash scripts/gpu_carry.sh            # here: the wheels the GPU machine lacks, into .gpu_carry/ (ignored, 35 MB)
    bash scripts/gpu_check.sh            # there (carry .gpu_carry): Qwen3-8B shape, DDP then FSDP2
    python bench/gpu_check.py --device cpu --tiny   # CI: the same code at toy size, so it cannot rot

What runs is the project's own code, not a copy: the drafter config and
model (raypipe.train.drafter, speculators' DFlashDraftModel) at the published
Qwen3-8B shape (hidden 4096, vocabulary 151,936, served layers 1, 9, 17, 25,
33, 36), 5 draft layers, block 16, 512 anchors, one 3,072-token sequence per
step; flex attention and speculators' fused loss on GPU; placement with bf16
frozen weights (DDP, or FSDP2 with bf16 parameters and fp32 reduction); the
step (raypipe.train.step); hidden states from pinned host memory copied on a
side stream (raypipe.train.batches.DeviceFeeder); metrics summed on the device
and all-reduced every 10 steps over a world-size-1 `cpu:gloo,cuda:nccl` group
(raypipe.train.metrics). It also times the same-node path's one host copy
(a states file in /dev/shm into a pinned buffer, raypipe.serve.transport) and
the pinned and pageable host-to-device copies. Hidden states and token ids are random: speed does
not depend on their values, and no target weights exist on that machine.

Model FLOPs per step (T context tokens, D = anchors x block drafted tokens,
H hidden, L draft layers, q = heads x head dim, kv = KV heads x head dim,
I MLP width, V vocabulary, a served aux layers; backward = 2 x forward):
  fc over the aux states (weight gradient only)   4 T a H^2
  draft layers                                    3 L [4 D H q + 4 (D + T) H kv + 6 D H I + 4 D (T/2 + B) q]
  LM head (input gradient only) + target's head   6 D H V
MFU = FLOPs per step / (step time x the GPU's dense bf16 peak).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s
# Imported by `import speculators` (its data-generation and EAGLE-3 data modules) but never used by the DFlash
# model or its losses; too large to carry (pyarrow, pandas, jiter) to a machine that cannot fetch anything.
IMPORTED_NOT_USED = ("datasets", "openai", "hs_connectors")


def use_carried_wheels() -> list[str]:
    """Make raypipe and .gpu_carry importable (after the machine's own packages); placeholders for IMPORTED_NOT_USED
    if absent."""
    sys.path.insert(0, str(ROOT))
    carry = ROOT / ".gpu_carry"
    if carry.is_dir():
        sys.path += [str(carry / "site"), str(carry / f"cp3{sys.version_info[1]}")]
    missing = [name for name in IMPORTED_NOT_USED if importlib.util.find_spec(name) is None]

    class Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
            return (
                importlib.machinery.ModuleSpec(fullname, self, is_package=True)
                if fullname.split(".")[0] in missing
                else None
            )

        def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = lambda name: type(name, (), {"__init__": _unavailable})  # type: ignore[method-assign]
            return module

        def exec_module(self, module: types.ModuleType) -> None:
            return None

    if missing:
        sys.meta_path.insert(0, Placeholders())
    return missing


def _unavailable(*_: Any, **__: Any) -> None:
    raise RuntimeError("not installed on this machine; the GPU check never uses it")


def model_flops(d: dict[str, int]) -> float:
    """The formula of the module docstring."""
    T, D, H, L, q, kv, I, V, a, B = (d[k] for k in ("T", "D", "H", "L", "q", "kv", "I", "V", "a", "B"))  # noqa: E741
    layers = 3 * L * (4 * D * H * q + 4 * (D + T) * H * kv + 6 * D * H * I + 4 * D * (T / 2 + B) * q)
    return 4 * T * a * H * H + layers + 6 * D * H * V


def copy_rate(device: Any, nbytes: int, pinned: bool, reps: int = 10) -> float:
    """Host-to-device GB/s of one step's hidden states, from pinned or pageable memory."""
    import torch

    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=pinned)
    stream = torch.cuda.Stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        host.to(device, non_blocking=pinned)  # warm-up
        start.record(stream)
        for _ in range(reps):
            host.to(device, non_blocking=pinned)
        end.record(stream)
    end.synchronize()
    return reps * nbytes / (start.elapsed_time(end) / 1000) / 1e9


def shm_to_pinned_rate(shape: tuple[int, ...], reps: int = 5) -> float:
    """GB/s of the same-node path's one host copy: a states file in /dev/shm into a pinned buffer
    (raypipe.serve.transport)."""
    import os
    import shutil

    import torch

    from raypipe.serve.transport import copy_states, hand_over, process_identity, replica_dir, write_states

    directory = replica_dir()
    ids = list(range(shape[0]))
    template = write_states(directory, "template", torch.randn(*shape).to(torch.bfloat16), ids)
    pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    seconds = 0.0
    for i in range(reps + 1):
        os.link(template, directory / f"r{i}.safetensors")
        handed = hand_over(str(directory / f"r{i}.safetensors"), ids, process_identity())
        start = time.perf_counter()
        copy_states(handed, pinned)
        seconds += (time.perf_counter() - start) if i else 0.0  # the first copy warms the buffer
    shutil.rmtree(directory)
    return reps * pinned.numel() * 2 / seconds / 1e9


def run_strategy(strategy: str, args: argparse.Namespace, target: Any, device: Any) -> dict[str, Any]:
    import numpy as np
    import torch
    from speculators.models.dflash import DFlashDraftModel

    from raypipe.config import TrainConfig
    from raypipe.train.anchors import install_row_anchors
    from raypipe.train.batches import DeviceFeeder, Step
    from raypipe.train.drafter import drafter_config, loss_implementation, share_verifier_head, step_kwargs
    from raypipe.train.metrics import StepMetrics
    from raypipe.train.rows import Row
    from raypipe.train.step import TrainState, make_optimizer, place_drafter, precision, train_step

    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": args.draft_layers, "block_size": args.block, "mask_token_id": 151_669},
        objective={"max_anchors": args.anchors, "max_pack_anchors": args.anchors},
        schedule={"step_tokens": args.seq, "seed": 0},
        run={"use_gpu": device.type == "cuda", "strategy": strategy},
    )
    config = drafter_config(target, tc)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDraftModel(config=config)  # random weights: the target's are not on this machine
        with torch.no_grad():
            for param in drafter.parameters():
                if (
                    not param.requires_grad and param.dim() == 2
                ):  # the target's embedding and heads, left empty until load_verifier_weights
                    param.normal_(0.0, 0.02)
    share_verifier_head(drafter)  # one head tensor, as build_drafter leaves it
    install_row_anchors(drafter, tc.objective.max_anchors)
    model = place_drafter(drafter, strategy, device)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    autocast, dtype = precision(device)
    state = TrainState(
        drafter,
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        tc.optim.grad_clip,
        step_kwargs(tc),
        autocast,
    )
    n_layers, hidden = len(target.layer_ids), target.shape.hidden_size
    states = torch.randn(args.seq, n_layers, hidden).to(torch.bfloat16)
    rng = np.random.default_rng(0)

    def steps() -> Any:
        for i in range(args.steps):
            ids = rng.integers(0, 151_643, args.seq, dtype=np.int64)
            yield Step(i, [Row(f"s{i}", ids, np.ones(args.seq, np.int64))]), [states]

    metrics = StepMetrics(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    logged: list[dict[str, float]] = []
    start = compile_s = 0.0
    t0 = time.perf_counter()
    for i, (_step, batch) in enumerate(DeviceFeeder(steps(), device, dtype)):
        if i == args.warmup:
            sync()
            start = time.perf_counter()
            compile_s = start - t0
        model_metrics = train_step(state, batch, args.anchors)  # one row of args.seq supervised tokens
        metrics.add(model_metrics, tokens=float(args.seq))
        if (i + 1) % args.log_every == 0:
            logged.append(metrics.reduce())
    sync()
    seconds = (time.perf_counter() - start) / (args.steps - args.warmup)
    flops = model_flops(
        {
            "T": args.seq,
            "D": args.anchors * args.block,
            "H": hidden,
            "L": args.draft_layers,
            "q": config.transformer_layer_config.num_attention_heads * config.transformer_layer_config.head_dim,
            "kv": config.transformer_layer_config.num_key_value_heads * config.transformer_layer_config.head_dim,
            "I": config.transformer_layer_config.intermediate_size,
            "V": target.shape.vocab_size,
            "a": n_layers - 1,
            "B": args.block,
        }
    )
    out: dict[str, Any] = {
        "strategy": strategy,
        "attention": config.transformer_layer_config._attn_implementation
        if hasattr(config.transformer_layer_config, "_attn_implementation")
        else None,
        "loss": f"{'+'.join(state.kwargs['loss_config'])} ({loss_implementation(tc)})",
        "step_s": seconds,
        "tokens_per_s": args.seq / seconds,
        "first_steps_s": compile_s,
        "model_tflops_per_step": flops / 1e12,
        "loss_first_last": [logged[0]["loss"], logged[-1]["loss"]] if logged else None,
        "metric_reductions": len(logged),
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        out.update(
            gpu=name,
            mfu=flops / seconds / peak if peak else None,
            peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
        )
        torch.cuda.reset_peak_memory_stats(device)
    del model, drafter, optimizer, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Toy shape (the tiny Qwen3 target, 1 draft layer, block 4, 16 anchors, 256 tokens): CI.",
    )
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--warmup", type=int, default=5, help="Steps left out of the timing (torch.compile of the drafter's forward)."
    )
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    if args.tiny:
        args.draft_layers, args.block, args.anchors, args.seq = 1, 4, 16, 256
        args.steps, args.warmup, args.log_every = min(args.steps, 4), min(args.warmup, 1), 2
    else:
        args.draft_layers, args.block, args.anchors, args.seq = 5, 16, 512, 3072
    placeholders = use_carried_wheels()

    import torch
    import torch.distributed as dist

    from raypipe.assets.published import write_config_dir
    from raypipe.assets.tiny_target import tiny_target_config
    from raypipe.target import load_target

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            tiny_target_config().save_pretrained(tmp)
        else:
            write_config_dir("Qwen/Qwen3-8B", Path(tmp))
        target = load_target("Qwen/Qwen3-8B" if not args.tiny else "tiny", tmp)
        shape = target.shape
        report: dict[str, Any] = {
            "torch": torch.__version__,
            "device": str(device),
            "placeholders_for": placeholders,
            "layer_ids": list(target.layer_ids),
            "shape": {
                "hidden": shape.hidden_size,
                "vocab": shape.vocab_size,
                "draft_layers": args.draft_layers,
                "block": args.block,
                "anchors": args.anchors,
                "seq": args.seq,
            },
            "runs": [],
        }
        report["shm_to_pinned_gb_per_s"] = shm_to_pinned_rate((args.seq, len(target.layer_ids), shape.hidden_size))
        if device.type == "cuda":
            nbytes = args.seq * len(target.layer_ids) * shape.hidden_size * 2
            report["h2d_gb_per_s"] = {
                "pinned": copy_rate(device, nbytes, True),
                "pageable": copy_rate(device, nbytes, False),
                "bytes_per_step": nbytes,
            }
        for strategy in args.strategies.split(","):
            report["runs"].append(run_strategy(strategy, args, target, device))
            print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
    dist.destroy_process_group()
    print(json.dumps(report, indent=1))
    if device.type == "cuda" and not args.tiny:  # CI's toy run on CPU says only that the path runs: not a figure
        figures = []
        for run in report["runs"]:
            name = run["strategy"]
            figures += [
                figure(f"{name}: step at the Qwen3-8B shape", run["step_s"], "s"),
                figure(f"{name}: tokens/s per GPU", round(run["tokens_per_s"]), "tokens/s"),
                figure(f"{name}: peak GPU memory", run["peak_memory_gib"], "GiB"),
            ]
            if run["mfu"] is not None:  # a GPU whose dense bf16 peak PEAK_BF16 lists
                figures.append(figure(f"{name}: MFU", 100 * run["mfu"], "%"))
        record("gpu_check", figures)


if __name__ == "__main__":
    main()
