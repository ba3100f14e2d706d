"""Placement and checkpoints of the drafter (raypipe.train.step): under FSDP2 only what trains is sharded, the frozen
embedding and head (one tensor for the logits and the targets) stay replicated, and a checkpoint round-trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from raypipe.config import TrainConfig
from raypipe.target import resolve_target
from raypipe.train.anchors import install_row_anchors
from raypipe.train.batches import drafter_inputs, pack_host
from raypipe.train.checkpoint import load_checkpoint, save_checkpoint
from raypipe.train.drafter import build_drafter, step_kwargs
from raypipe.train.rows import Row
from raypipe.train.step import TrainState, make_optimizer, place_drafter, precision, train_step
from raypipe.train.vocab import DraftVocab, vocab_from_counts
from tests.helpers import free_port, serve_config


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real gloo process group of one rank, as a Ray Train worker has."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def placed(tiny_target: str, strategy: str, vocab: DraftVocab | None) -> tuple[TrainState, Any]:
    """The tiny target's drafter placed as the loop places it, in a TrainState, with its target."""
    target = resolve_target(serve_config(tiny_target))
    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 1, "block_size": 4, "draft_vocab_size": 256 if vocab else None},
        objective={"max_anchors": 16},
        schedule={"step_tokens": 256, "seed": 0},
        run={"use_gpu": False, "strategy": strategy},
    )
    drafter = build_drafter(target, tc, vocab)
    install_row_anchors(drafter, tc.objective.max_anchors)
    model = place_drafter(drafter, strategy, torch.device("cpu"))
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], 1e-2, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    autocast = precision(torch.device("cpu"))[0]
    return TrainState(drafter, model, optimizer, scheduler, 1.0, step_kwargs(tc), autocast), target


def step(state: TrainState, target: Any, seed: int) -> dict[str, torch.Tensor]:
    """One optimizer step on two rows of 64 supervised tokens with random states, the same anchors for a seed."""
    rng = np.random.default_rng(seed)
    rows = [Row(f"r{seed}-{i}", rng.integers(0, 150_000, 64), np.ones(64, np.int64)) for i in range(2)]
    shape = (64, len(target.layer_ids), target.shape.hidden_size)
    states = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for _ in rows]
    torch.manual_seed(seed)
    return train_step(state, drafter_inputs(pack_host(rows, states, pin=False), torch.float32), 32)


def weights(state: TrainState) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in state.params]


def test_fsdp2_shards_what_trains_and_replicates_the_frozen_head_one_tensor(
    tiny_target: str, one_rank_group: Any
) -> None:
    ddp, target = placed(tiny_target, "ddp", None)
    fsdp2, _ = placed(tiny_target, "fsdp2", None)
    drafter = fsdp2.drafter
    assert drafter.verifier_lm_head.weight is drafter.lm_head.weight, "the targets' head is the drafter's head"
    frozen = [(n, p) for n, p in drafter.named_parameters(remove_duplicate=False) if not p.requires_grad]
    assert {n for n, _ in frozen} == {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    assert not any(isinstance(p, DTensor) for _, p in frozen), "a frozen parameter is sharded: FSDP2 gathers it"
    assert all(isinstance(p, DTensor) for p in fsdp2.params)
    # The same training either way: the frozen head reaches the logits and the targets alike.
    for seed in (1, 2):
        a, b = step(ddp, target, seed), step(fsdp2, target, seed)
        assert torch.allclose(a["loss_sum"], b["loss_sum"]) and torch.equal(a["loss_total"], b["loss_total"])
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(weights(ddp), weights(fsdp2), strict=True))


def test_an_fsdp2_checkpoint_with_a_draft_vocabulary_saves_its_head_once_and_round_trips(
    tiny_target: str, one_rank_group: Any, tmp_path: Path
) -> None:
    counts = np.zeros(resolve_target(serve_config(tiny_target)).shape.vocab_size, np.int64)
    counts[np.arange(100, 100 + 3 * 300, 3)] = np.arange(300, 0, -1)
    vocab = vocab_from_counts(counts, 256)
    state, target = placed(tiny_target, "fsdp2", vocab)
    step(state, target, 1)
    state.progress.step = 1
    save_checkpoint(tmp_path, state, {"name": "step"}, {"target_path": target.path}, write=True)

    saved = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    trainable = {n for n, p in state.drafter.named_parameters() if p.requires_grad}
    # what save_pretrained wrote before issue 39: trainable weights, the mapping, the draft vocabulary's head
    assert set(saved) == trainable | {"t2d", "d2t", "lm_head.weight"}
    head = load_file(f"{target.path}/model.safetensors")["lm_head.weight"]
    assert torch.equal(saved["lm_head.weight"], head[vocab.t2d])

    resumed, _ = placed(tiny_target, "fsdp2", vocab)
    load_checkpoint(tmp_path, resumed)
    assert resumed.progress.step == 1
    assert all(torch.equal(x, y) for x, y in zip(weights(resumed), weights(state), strict=True))
    assert resumed.drafter.verifier_lm_head.weight is resumed.drafter.lm_head.weight
    assert torch.equal(resumed.drafter.lm_head.weight, head[vocab.t2d])
    assert torch.equal(step(resumed, target, 2)["loss_sum"], step(state, target, 2)["loss_sum"])
    assert all(torch.equal(x, y) for x, y in zip(weights(resumed), weights(state), strict=True))
