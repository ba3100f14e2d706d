"""The one prepared GPU check: raypipe's drafter and train step at the production shapes, as training runs them.

    bash scripts/gpu_carry.sh            # here: the wheels the GPU machine lacks, into .gpu_carry/ (ignored, 35 MB)
    bash scripts/gpu_check.sh            # there (carry .gpu_carry): both shapes on 1 GPU, then 2 where there are 2
    python bench/gpu_check.py --device cpu   # CI: the same code at reduced shapes, so it cannot rot

What runs is the project's own code, not a copy, without Ray: each shipped
recipe (qwen3_8b, qwen36_27b) loaded as a run loads it, its target's
published config written in code (raypipe.assets.published: the Hub's
config.json values; tests/test_sizing.py checks the shapes every stage derives
from them), the drafter that config gives (raypipe.train.drafter,
speculators' DFlashDraftModel: Qwen3-8B 32 heads x 128, 8 KV heads, hidden
4096, vocabulary 151,936; Qwen3.6-27B, a composite config: from its text
config's 24 heads x 256, which do not make its hidden 5120, speculators gives
the drafter 5120 / 256 = 20 heads, with its 4 KV heads and vocabulary 248,320),
the recipe's 5 draft layers and block 16,
placement with the recipe's strategy (raypipe.train.step.place_drafter: DDP for
Qwen3-8B, FSDP2 for Qwen3.6-27B), TrainState and train_step, the device
feeder (raypipe.train.batches.DeviceFeeder) and the metric reductions
(raypipe.train.metrics) every `train.run.log_every` steps.

Each step's pack and anchors come as training makes them: random rows
(lengths log-uniform in [64, data.max_length], 777 tokens on average at
3,072, like the 551 of docs/benchmarks_log.md's multi-turn mix; the first
10-60 % of each a prompt outside the loss) packed greedily up to
train.schedule.step_tokens (raypipe.train.plan.pack_rows), rank r of W taking
pack s*W + r at step s (EpochPlan.pack_index), anchors from
raypipe.train.anchors.anchor_count (up to max_anchors per row, max_pack_anchors
per pack). So pack length and anchor count change every step. On GPU,
speculators compiles the drafter's forward (torch.compile: static shapes
first, dynamic after the first change) and its flex-attention block mask; the
check counts the graphs compiled, times only steps that compiled nothing, and
fails instead of falling back to eager when Dynamo's recompile limit is hit
(training would go on slowly there). Hidden states and token ids are random:
speed does not depend on their values, and no target weights exist on that
machine. Rank 0 also times the same-node path's one host copy (a states file
in /dev/shm into a pinned buffer, raypipe.serve.transport) and the pinned and
pageable host-to-device copies of a pack's states.

Memory: a GPU gets the recipe's max_pack_anchors, halved until
raypipe.sizing's training estimate per GPU (parameters, gradients, Adam, the
pack's states and its logits at 8 bytes per logit) stays within 0.8 of the
GPU's memory, tests/test_sizing.py's margin for activations and the allocator.
The anchors are the knob: a step's logits (anchors x block x vocabulary,
drafter's and target's) are most of its memory; its states are 0.2 GB per
3,072 tokens at Qwen3.6-27B. By that estimate Qwen3.6-27B on one 80 GB H100
(FSDP2 over one GPU shards nothing) needs 31.3 GiB of parameters, gradients,
Adam and the frozen embedding and head (one tensor for the drafter's two heads)
plus 30.5 GiB of logits at 1,024 anchors: 61.8 GiB, within 0.8 x 79.2 GiB by
1.6 GiB, and the 20% left must hold 10-20 GiB of activations (5 layers of
16,384 drafted tokens, MLP width 17,408): a thin margin, which the first GPU
run's peak memory settles. A smaller GPU gets fewer anchors (an L40S, 128);
over 2 GPUs (FSDP2) or on an H200 it keeps 1,024. Qwen3-8B keeps 1,024
everywhere.

Model FLOPs per step and GPU (T pack tokens, c mean position within its row of
the pack's supervised tokens (anchors are drawn among them), D = anchors x B
drafted tokens, B block, H hidden, L draft layers, q = heads x head dim,
kv = KV heads x head dim, I MLP width, V vocabulary, a auxiliary target layers;
backward = 2 x forward):
  fc over the aux states (weight gradient only)            4 T a H^2
  draft layers                                             3 L [4 D H q + 4 (D + T) H kv + 6 D H I + 4 D (c + B) q]
  draft LM head (input gradient only)                      4 D H V
  target's LM head (forward; over the whole pack if D >= T) 2 min(D, T) H V
MFU = FLOPs of the timed steps, all GPUs / (their time x GPUs x the GPU's dense
bf16 peak). A step is timed between two device syncs (the loop itself syncs
only at metric reductions), the feeder's wait included; timed steps are those
after --warmup that compiled nothing, on any rank. Prints one JSON line per
shape and appends it to --out.
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s
GIB = 1 << 30
SHORTEST_ROW = 64  # random rows are log-uniform in [64, data.max_length] tokens: 777 on average at 3,072
# Imported by `import speculators` (its data-generation and EAGLE-3 data modules) but never used by the DFlash
# model or its losses; too large to carry (pyarrow, pandas, jiter) to a machine that cannot fetch anything.
IMPORTED_NOT_USED = ("datasets", "openai", "hs_connectors")
PUBLISHED_TARGETS = {"qwen3_8b": "Qwen/Qwen3-8B", "qwen36_27b": "Qwen/Qwen3.6-27B"}  # recipe: its serve.model
# CPU mode: the recipes at a size CI runs in seconds (sdpa, fp32, no compile: speculators compiles only with CUDA).
CPU_OVERRIDES = [
    "data.max_length=256",
    "train.schedule.step_tokens=256",
    "train.drafter.draft_layers=1",
    "train.drafter.block_size=4",
    "train.objective.max_anchors=8",
    "train.objective.max_pack_anchors=16",
    "train.run.log_every=2",
]


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


def cpu_target_config(recipe: str) -> Any:
    """The recipe's target architecture at CPU size. Qwen3-8B: the tiny Qwen3. Qwen3.6-27B: its composite config with
    the 27B's attention geometry (heads of 256, 24 query heads: speculators gives the drafter hidden / 256 heads,
    here 512 / 256 = 2, sharing 1 KV head) and 8 layers (five auxiliary ones, as at 27B), vocabulary cut to 16,384."""
    from raypipe.assets.tiny_target import qwen36_config, tiny_target_config

    if recipe == "qwen3_8b":
        return tiny_target_config()
    return qwen36_config(
        {
            "vocab_size": 16_384,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_attention_heads": 24,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "num_hidden_layers": 8,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
            "rope_parameters": {  # the 27B's (raypipe.assets.published)
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        },
        (16_380, 16_381, 16_382, 16_383),  # media token ids: unused by a drafter
    )


def load_shape(recipe: str, cuda: bool, world: int, directory: Path) -> tuple[Any, Any]:
    """(config, target) of `recipe` with its target's config written to `directory`: the published one on GPU, the
    CPU-size one on CPU."""
    from transformers import AutoConfig

    from raypipe.assets.published import write_config_dir
    from raypipe.config import load_config
    from raypipe.target import resolve_target

    if cuda:
        write_config_dir(PUBLISHED_TARGETS[recipe], directory)
    else:
        cpu_target_config(recipe).save_pretrained(directory)
    vocab = AutoConfig.from_pretrained(directory).get_text_config().vocab_size
    overrides = [
        f"serve.model={directory}",
        f"train.drafter.mask_token_id={vocab - 1}",  # a padding row of the vocabulary (no tokenizer here)
        f"train.run.use_gpu={cuda}",
        f"train.run.num_workers={world}",
        *([] if cuda else CPU_OVERRIDES),
    ]
    cfg = load_config(recipe, overrides)
    return cfg, resolve_target(cfg.serve)


def fit_pack_anchors(cfg: Any, target: Any, gpu_bytes: int) -> float:
    """Halve cfg.train.objective.max_pack_anchors until raypipe.sizing's training bytes per GPU are at most 0.8 of
    `gpu_bytes` (the module docstring says why); returns that estimate in GiB."""
    from raypipe.sizing import size_run
    from raypipe.train.drafter import drafter_on_meta

    drafter = drafter_on_meta(target, cfg.train)
    while (estimate := size_run(cfg, target, drafter).train_bytes_per_gpu) > 0.8 * gpu_bytes:
        cfg.train.objective.max_pack_anchors //= 2  # validated: 0 raises
    return estimate / GIB


def random_rows(cfg: Any, vocab: int, count: int, seed: int) -> list[Any]:
    """`count` rows of the shape data preparation emits (module docstring); tokens below `vocab` - 1, the mask id."""
    import numpy as np

    from raypipe.train.rows import Row

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        n = int(np.exp(rng.uniform(np.log(SHORTEST_ROW), np.log(cfg.data.max_length + 1))))
        mask = np.ones(n, np.int64)
        mask[: int(n * rng.uniform(0.1, 0.6))] = 0
        rows.append(Row(f"r{i}", rng.integers(0, vocab - 1, n, dtype=np.int64), mask))
    return rows


def rank_packs(cfg: Any, vocab: int, steps: int, rank: int, world: int) -> list[list[Any]]:
    """The packs `rank` of `world` trains in its first `steps` steps, as the loop takes them from an epoch's plan."""
    import numpy as np

    from raypipe.train.plan import EpochPlan, pack_rows

    rows = random_rows(cfg, vocab, 8 * steps * world, seed=0)  # about 3.5 rows a pack at the recipes' 3,072 tokens
    lengths = np.array([len(r.input_ids) for r in rows])
    plan = EpochPlan(0, pack_rows(np.arange(len(rows)), lengths, cfg.train.schedule.step_tokens))
    assert len(plan.packs) >= steps * world, "too few random rows for the steps"
    return [[rows[i] for i in plan.packs[plan.pack_index(0, s, rank, world)]] for s in range(steps)]


def mean_context(pack: list[Any]) -> float:
    """Mean position within its row of a pack's supervised tokens: the context an anchor drawn among them attends
    to."""
    import numpy as np

    positions = [np.flatnonzero(r.loss_mask) for r in pack]
    return float(sum(p.sum() for p in positions) / max(1, sum(len(p) for p in positions)))


def model_flops(d: dict[str, float]) -> float:
    """The formula of the module docstring."""
    T, D, c, H, L, q, kv, I, V, a, B = (d[k] for k in ("T", "D", "c", "H", "L", "q", "kv", "I", "V", "a", "B"))  # noqa: E741
    layers = 3 * L * (4 * D * H * q + 4 * (D + T) * H * kv + 6 * D * H * I + 4 * D * (c + B) * q)
    return 4 * T * a * H * H + layers + 4 * D * H * V + 2 * min(D, T) * H * V


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


def run_shape(
    recipe: str, args: argparse.Namespace, rank: int, world: int, device: Any, directory: Path
) -> dict[str, Any]:
    """`args.steps` training steps of `recipe`'s drafter on this rank, its target's config in `directory` (the drafter
    reads it while it builds); the report of rank 0 holds the copy rates too."""
    import torch
    import torch.distributed as dist
    from speculators.models.dflash import DFlashDraftModel
    from torch._dynamo.utils import counters

    from raypipe.train.anchors import anchor_count, install_row_anchors
    from raypipe.train.batches import DeviceFeeder, Step
    from raypipe.train.drafter import drafter_config, loss_implementation, share_verifier_head
    from raypipe.train.metrics import StepMetrics
    from raypipe.train.step import TrainState, place_drafter, precision, train_step

    cuda = device.type == "cuda"
    cfg, target = load_shape(recipe, cuda, world, directory)
    tc = cfg.train
    recipe_anchors = tc.objective.max_pack_anchors
    estimate = fit_pack_anchors(cfg, target, torch.cuda.get_device_properties(device).total_memory) if cuda else None
    config = drafter_config(target, tc)
    layer = config.transformer_layer_config
    n_layers, hidden, vocab = len(target.layer_ids), target.shape.hidden_size, target.shape.vocab_size

    packs = rank_packs(cfg, vocab, args.steps, rank, world)
    anchors = [
        anchor_count(
            [r.loss_mask for r in p], tc.objective.max_anchors, tc.objective.max_pack_anchors, tc.drafter.block_size
        )
        for p in packs
    ]
    tokens = [sum(len(r.input_ids) for r in p) for p in packs]
    dims = {
        "H": hidden,
        "L": tc.drafter.draft_layers,
        "q": layer.num_attention_heads * layer.head_dim,
        "kv": layer.num_key_value_heads * layer.head_dim,
        "I": layer.intermediate_size,
        "V": vocab,
        "a": n_layers - 1,
        "B": tc.drafter.block_size,
    }
    flops = [
        model_flops({**dims, "T": t, "D": a * tc.drafter.block_size, "c": mean_context(p)})
        for p, t, a in zip(packs, tokens, anchors, strict=True)
    ]
    states = torch.randn(cfg.data.max_length, n_layers, hidden, dtype=torch.bfloat16)  # each row takes its first rows

    report: dict[str, Any] = {"shape": recipe, "target": PUBLISHED_TARGETS[recipe] if cuda else "CPU size"}
    if rank == 0:
        report["shm_to_pinned_gb_per_s"] = shm_to_pinned_rate((tc.schedule.step_tokens, n_layers, hidden))
        if cuda:
            nbytes = tc.schedule.step_tokens * n_layers * hidden * 2
            report["h2d_gb_per_s"] = {
                "pinned": copy_rate(device, nbytes, True),
                "pageable": copy_rate(device, nbytes, False),
                "bytes_per_step": nbytes,
            }

    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        drafter = DFlashDraftModel(config=config)  # random weights: the target's are not on this machine
        with torch.no_grad():
            for param in drafter.parameters():
                if not param.requires_grad and param.dim() == 2:  # the target's embedding and heads, left empty
                    param.normal_(0.0, 0.02)  # until load_verifier_weights
    share_verifier_head(drafter)  # one head tensor, as build_drafter leaves it
    install_row_anchors(drafter, tc.objective.max_anchors)
    model = place_drafter(drafter, tc.run.strategy, device)
    state = TrainState.create(drafter, model, tc, device, total_steps=args.steps)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def steps() -> Any:
        for s, pack in enumerate(packs):
            yield Step(s, pack), [states[: len(r.input_ids)] for r in pack]

    metrics = StepMetrics(device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    logged: list[dict[str, float]] = []
    seconds: list[float] = []
    compiled: list[int] = []
    graphs_before = counters["stats"]["unique_graphs"]
    tick = time.perf_counter()
    for s, (_step, batch) in enumerate(DeviceFeeder(steps(), device, precision(device)[1])):
        graphs = counters["stats"]["unique_graphs"]
        model_metrics = train_step(state, batch, anchors[s])
        metrics.add(model_metrics, tokens=float(tokens[s]))
        if (s + 1) % tc.run.log_every == 0:
            logged.append(metrics.reduce())
        sync()
        seconds.append(time.perf_counter() - tick)
        compiled.append(counters["stats"]["unique_graphs"] - graphs)
        tick = time.perf_counter()

    # Per step: the slowest rank's time, whether any rank compiled, tokens and FLOPs of all ranks.
    slowest = torch.tensor([seconds, compiled], dtype=torch.float64)
    summed = torch.tensor([tokens, flops], dtype=torch.float64)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(summed)
    timed = [s for s in range(args.warmup, args.steps) if slowest[1, s] == 0]
    time_s = float(slowest[0, timed].sum())
    report.update(
        {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "world_size": world,
            "strategy": tc.run.strategy,
            "attention": layer._attn_implementation,
            "loss": f"{'+'.join(state.kwargs['loss_config'])} ({loss_implementation(tc)})",
            "compiled": hasattr(DFlashDraftModel.forward, "_torchdynamo_orig_callable"),
            "drafter": {
                "hidden": hidden,
                "heads": layer.num_attention_heads,
                "head_dim": layer.head_dim,
                "kv_heads": layer.num_key_value_heads,
                "intermediate": layer.intermediate_size,
                "vocab": vocab,
                "draft_layers": tc.drafter.draft_layers,
                "block": tc.drafter.block_size,
                "layer_ids": list(target.layer_ids),
                "multimodal_target": target.shape.multimodal,
            },
            "data": {
                "step_tokens": tc.schedule.step_tokens,
                "max_anchors": tc.objective.max_anchors,
                "max_pack_anchors": tc.objective.max_pack_anchors,
                "recipe_max_pack_anchors": recipe_anchors,
                "pack_tokens_min_median_max": [min(tokens), int(statistics.median(tokens)), max(tokens)],
                "anchors_min_median_max": [min(anchors), int(statistics.median(anchors)), max(anchors)],
            },
            "steps": args.steps,
            "timed_steps": len(timed),
            "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
            "steps_compiling_after_warmup": int(slowest[1, args.warmup :].gt(0).sum()),
            "warmup_s": float(slowest[0, : args.warmup].sum()),
            "step_s_median": statistics.median(slowest[0, timed].tolist()) if timed else None,
            "tokens_per_s_per_gpu": float(summed[0, timed].sum()) / time_s / world if timed else None,
            "model_tflops_per_step": float(summed[1, timed].mean()) / world / 1e12 if timed else None,
            "loss_first_last": [logged[0]["loss"], logged[-1]["loss"]] if logged else None,
            "metric_reductions": len(logged),
        }
    )
    if cuda:
        name = report["device"]
        peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)
        report.update(
            mfu=float(summed[1, timed].sum()) / (time_s * world * peak_flops) if timed and peak_flops else None,
            peak_memory_gib=float(peak[0]) / GIB,
            estimated_train_gib=estimate,
        )
    return report


def run_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """One rank: every shape in turn; rank 0 prints and appends each report."""
    placeholders = use_carried_wheels()

    import torch
    import torch.distributed as dist

    torch._dynamo.config.fail_on_recompile_limit_hit = True  # a silent eager fallback would be measured as the speed
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    reports = []
    for recipe in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            report = run_shape(recipe, args, rank, world, device, Path(tmp))
        report.update(torch=torch.__version__, placeholders_for=placeholders)
        reports.append(report)
        torch._dynamo.reset()  # the next shape gets its own recompile budget, and this one's model goes
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if rank == 0:
            line = json.dumps(report)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(line + "\n")
    dist.destroy_process_group()
    if rank == 0 and cuda and world == 1:  # CI's run on CPU says only that the path runs: not a figure
        figures = []
        for r in [r for r in reports if r["timed_steps"]]:
            shape = r["shape"]
            figures += [
                figure(f"{shape}: median step", r["step_s_median"], "s"),
                figure(f"{shape}: tokens/s per GPU", round(r["tokens_per_s_per_gpu"]), "tokens/s"),
                figure(f"{shape}: peak GPU memory", r["peak_memory_gib"], "GiB"),
            ]
            if r["mfu"] is not None:  # a GPU whose dense bf16 peak PEAK_BF16 lists
                figures.append(
                    figure(f"{shape}: MFU", 100 * r["mfu"], "%", at_least=40.0 if shape == "qwen3_8b" else None)
                )
        if figures:
            record("gpu_check", figures)


def free_port() -> int:
    """A free local port for the ranks' rendezvous: runs side by side (CI's workers) never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the recipes at CPU size.")
    parser.add_argument("--shapes", default="qwen3_8b,qwen36_27b", help="Recipes to run, in order.")
    parser.add_argument("--world-size", type=int, default=1, help="Ranks, one GPU each (gloo processes on CPU).")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--warmup", type=int, default=5, help="First steps left out of the timing (torch.compile's first graphs)."
    )
    parser.add_argument("--out", help="File each shape's JSON line is appended to.")
    args = parser.parse_args()
    if args.device == "cpu":
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
    unknown = set(args.shapes.split(",")) - set(PUBLISHED_TARGETS)
    if unknown:
        raise ValueError(f"--shapes: unknown {sorted(unknown)}; choose among {', '.join(PUBLISHED_TARGETS)}")
    port = free_port()
    if args.world_size == 1:
        run_rank(0, 1, args, port)
        return
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise ValueError(
            f"--world-size {args.world_size} needs as many GPUs; this machine has {torch.cuda.device_count()}"
        )
    torch.multiprocessing.spawn(run_rank, args=(args.world_size, args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
