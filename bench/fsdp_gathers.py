"""Bytes all-gathered per optimizer step and per checkpoint by an FSDP2 drafter, before and after issue 39, side by
side in one run.

Two gloo ranks on the CPU build the drafter of `builtin:tiny` (a Qwen3 of hidden size 64 with Qwen's 151,936-token
vocabulary; five draft layers, block 4) as the training stage builds it, and take `--steps` optimizer steps on the
same packed batches, then gather a checkpoint's state dicts, under:
  before  the placement before issue 39: every draft layer and the drafter root under fully_shard, the root covering
          the frozen embedding, LM head and the target's LM head (speculators' second copy of it), and torch's full
          state dicts of model and optimizer (get_model_state_dict / get_optimizer_state_dict) for a checkpoint;
  after   raypipe.train.step as it is: place_drafter shards only what trains (the frozen parameters are FSDP2's
          ignored_params, the two heads one tensor) and TrainState.state_dict gathers no frozen parameter.
Every all-gather that reaches the dispatcher is counted by the bytes this rank receives (its output): FSDP2's
c10d._allgather_base_ in the step, DTensor's _c10d_functional.all_gather_into_tensor in the state dicts. The losses
of both placements and the drafter files save_pretrained writes from both state dicts are compared too.

The counts are set against raypipe.sizing's formulas at this shape (fp32 on the CPU), then the formulas give the
bytes at the production recipes' drafters (built on the meta device from the published configs, bf16 parameters):
Qwen3.6-27B (qwen36_27b, FSDP2 over 4 workers) and Qwen3-8B (qwen3_8b, were it run under FSDP2).

    python bench/fsdp_gathers.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from figures import figure, record  # bench/ is on sys.path when this runs as a script
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

GB = 1e9
RECIPES = {"qwen36_27b": "Qwen/Qwen3.6-27B", "qwen3_8b": "Qwen/Qwen3-8B"}


class GatherBytes(TorchDispatchMode):
    """Bytes this rank receives from the all-gathers run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.name()
        if name == "c10d::_allgather_base_":  # (output, input, ...): FSDP2's all-gather
            self.bytes += args[0].numel() * args[0].element_size()
        elif name == "_c10d_functional::all_gather_into_tensor":  # (input, group size, group): DTensor.full_tensor
            self.bytes += args[0].numel() * args[0].element_size() * args[1]
        else:
            collective = name.startswith(("c10d::", "_c10d_functional::"))
            assert not (collective and "gather" in name), f"an all-gather not counted: {name}"
        return func(*args, **(kwargs or {}))


def tiny() -> tuple[Any, Any]:
    """The bench's target and training config: `builtin:tiny`, five draft layers, block 4, FSDP2 on the CPU."""
    from raypipe.config import ServeConfig, TrainConfig
    from raypipe.target import resolve_target

    target = resolve_target(ServeConfig(model="builtin:tiny", num_gpus=0, resource=None, kv_cache_gib=1))
    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 5, "block_size": 4},
        objective={"max_anchors": 16},
        schedule={"step_tokens": 256, "seed": 0},
        run={"use_gpu": False, "strategy": "fsdp2"},
    )
    return target, tc


def build(placement: str) -> Any:
    """The tiny target's drafter, placed, in a TrainState, as the training stage builds it (`placement`: before or
    after issue 39)."""
    from torch.distributed.fsdp import fully_shard

    from raypipe.train.anchors import install_row_anchors
    from raypipe.train.drafter import build_drafter, step_kwargs
    from raypipe.train.step import TrainState, make_optimizer, place_drafter, precision

    target, tc = tiny()
    drafter = build_drafter(target, tc, None)
    install_row_anchors(drafter, tc.objective.max_anchors)
    if placement == "before":
        # speculators' own copy of the target's head, and place_drafter before issue 39 (on the CPU)
        drafter.verifier_lm_head.weight = torch.nn.Parameter(drafter.lm_head.weight.detach().clone(), False)
        for layer in drafter.layers:
            fully_shard(layer)
        model = fully_shard(drafter)
    else:
        model = place_drafter(drafter, "fsdp2", torch.device("cpu"))
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], 1e-3, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    autocast = precision(torch.device("cpu"))[0]
    return TrainState(drafter, model, optimizer, scheduler, tc.optim.grad_clip, step_kwargs(tc), autocast), target


def batch(target: Any, seed: int) -> dict[str, torch.Tensor]:
    """Two rows of 64 supervised tokens with random states, packed as the loop packs them."""
    from raypipe.train.batches import drafter_inputs, pack_host
    from raypipe.train.rows import Row

    rng = np.random.default_rng(seed)
    rows = [Row(f"r{seed}-{i}", rng.integers(0, 150_000, 64), np.ones(64, np.int64)) for i in range(2)]
    shape = (64, len(target.layer_ids), target.shape.hidden_size)
    states = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for _ in rows]
    return drafter_inputs(pack_host(rows, states, pin=False), torch.float32)


def measure(placement: str, steps: int, out: Path) -> dict[str, Any]:
    """Bytes gathered by each step and by one checkpoint's state dicts, the losses, and (rank 0) the drafter files
    save_pretrained writes in `out`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from raypipe.train.step import train_step

    state, target = build(placement)
    step_bytes, losses = [], []
    for step in range(steps):
        torch.manual_seed(step)  # the same anchors under both placements
        with GatherBytes() as counter:
            metrics = train_step(state, batch(target, 100 * dist.get_rank() + step), 32)
        step_bytes.append(counter.bytes)
        losses.append(float(metrics["loss_sum"] / metrics["loss_total"]))
    with GatherBytes() as counter:
        if placement == "before":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = {
                "model": get_model_state_dict(state.model, options=options),
                "optimizer": get_optimizer_state_dict(state.model, state.optimizer, options=options),
            }
        else:
            full = state.state_dict()
    if dist.get_rank() == 0:
        state.drafter.save_pretrained(out / placement, state_dict=full["model"])
    return {"step_bytes": step_bytes, "checkpoint_bytes": counter.bytes, "losses": losses}


def drafter_params(drafter: torch.nn.Module) -> dict[str, int]:
    """A drafter's parameters as the formulas take them: draft layers, the root's other trainable ones, frozen ones
    (after: the two heads one tensor; before: counted twice)."""
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    layers = sum(p.numel() for p in drafter.layers.parameters())
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    return {
        "layers": layers,
        "root": trainable - layers,
        "trainable": trainable,
        "frozen_after": frozen,
        "frozen_before": frozen + drafter.lm_head.weight.numel(),
    }


def formulas(params: dict[str, int], param_bytes: int) -> dict[str, dict[str, int]]:
    from raypipe.sizing import fsdp_gather_bytes_per_checkpoint, fsdp_gather_bytes_per_step

    return {
        placement: {
            "step_bytes": fsdp_gather_bytes_per_step(
                params["layers"], params["root"], params[f"frozen_{placement}"], placement == "before", param_bytes
            ),
            "checkpoint_bytes": fsdp_gather_bytes_per_checkpoint(
                params["trainable"], params[f"frozen_{placement}"], placement == "before", param_bytes
            ),
        }
        for placement in ("before", "after")
    }


def production(recipe: str) -> dict[str, Any]:
    """The formulas at a production recipe's drafter (meta device, the published config), bf16 parameters."""
    from raypipe.assets.published import write_config_dir
    from raypipe.config import load_config
    from raypipe.target import resolve_target
    from raypipe.train.drafter import drafter_on_meta

    with tempfile.TemporaryDirectory() as tmp:
        directory = write_config_dir(RECIPES[recipe], Path(tmp))
        cfg = load_config(recipe, [f"serve.model={directory}", "train.drafter.mask_token_id=151669"])
        params = drafter_params(drafter_on_meta(resolve_target(cfg.serve), cfg.train))
    return {"params": params, **formulas(params, 2)}


def rank_main(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {placement: measure(placement, steps, Path(out)) for placement in ("before", "after")}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, port, args.steps, out), nprocs=2)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in (0, 1)]
        files = {p: load_file(str(Path(out, p, "model.safetensors"))) for p in ("before", "after")}
    for placement in ("before", "after"):
        for key in ("step_bytes", "checkpoint_bytes"):
            assert ranks[0][placement][key] == ranks[1][placement][key], (placement, key, "the ranks differ")
        assert len(set(ranks[0][placement]["step_bytes"])) == 1, (placement, "the steps gathered different bytes")
    assert files["before"].keys() == files["after"].keys() and all(
        torch.equal(files["before"][k], files["after"][k]) for k in files["before"]
    ), "save_pretrained wrote other drafter files"
    loss_diff = max(abs(a - b) for r in ranks for a, b in zip(r["before"]["losses"], r["after"]["losses"], strict=True))
    measured = {
        p: {"step_bytes": ranks[0][p]["step_bytes"][0], "checkpoint_bytes": ranks[0][p]["checkpoint_bytes"]}
        for p in ("before", "after")
    }

    from raypipe.train.drafter import build_drafter

    target, tc = tiny()
    params = drafter_params(build_drafter(target, tc, None))
    shapes = {recipe: production(recipe) for recipe in RECIPES}
    rows = {"builtin:tiny, measured": measured, "builtin:tiny, formula (fp32)": formulas(params, 4)}
    rows |= {f"{recipe}, formula (bf16)": shapes[recipe] for recipe in RECIPES}
    print(f"{'shape':<30} {'gathered':<15} {'before':>15} {'after':>15} {'after/before':>13}")
    for label, r in rows.items():
        for key, what in (("step_bytes", "per step"), ("checkpoint_bytes", "per checkpoint")):
            before, after = r["before"][key], r["after"][key]
            print(f"{label:<30} {what:<15} {before:>15,} {after:>15,} {after / before:>13.4f}")
    print(f"parameters: builtin:tiny {params}; " + "; ".join(f"{k} {v['params']}" for k, v in shapes.items()))
    print(f"losses, before against after: max difference {loss_diff}; the files save_pretrained writes: equal")

    figures = [
        figure(f"builtin:tiny drafter, 2 ranks: gathered {what}, {p}", measured[p][key] / 1e6, "MB")
        for key, what in (("step_bytes", "per step"), ("checkpoint_bytes", "per checkpoint"))
        for p in ("before", "after")
    ]
    figures.append(figure("builtin:tiny drafter: largest loss difference, before against after", loss_diff))
    figures += [
        figure(f"{recipe} drafter: gathered {what}, {p} (formula)", r[p][key] / GB, "GB")
        for recipe, r in shapes.items()
        for key, what in (("step_bytes", "per step"), ("checkpoint_bytes", "per checkpoint"))
        for p in ("before", "after")
    ]
    record("fsdp_gathers", figures)


if __name__ == "__main__":
    main()
