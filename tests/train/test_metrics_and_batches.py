"""Metrics reduced on the training device once per interval; steps packed and moved to the device off the training
thread."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from raypipe.train.batches import DeviceFeeder, Step
from raypipe.train.metrics import StepMetrics
from raypipe.train.rows import Row
from tests.helpers import free_port


def _model_metrics(device: str, loss: float, acc: float) -> dict[str, torch.Tensor]:
    """What speculators' DFlash forward returns: 0-dim sum/total tensors on the device."""
    values = {
        "loss_sum": loss,
        "loss_total": 1.0,
        "eal_sum": 1.0 + acc,
        "eal_total": 1.0,
        "position_1_acc_sum": acc,
        "position_1_acc_total": 1.0,
    }
    return {k: torch.tensor(v, device=device) for k, v in values.items()}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    metrics = StepMetrics(torch.device("cpu"))
    for step in range(3):
        metrics.add(_model_metrics("cpu", loss=rank + step, acc=0.5 * rank), tokens=100.0, wait_s=0.5, step_s=2.0)
    torch.save(metrics.reduce(), Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def test_metrics_are_reduced_over_ranks_and_steps_with_a_real_gloo_group(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    [r0, r1] = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    assert r0 == r1  # every rank gets the same means
    assert r0["loss"] == pytest.approx((0 + 1 + 2 + 1 + 2 + 3) / 6)
    assert r0["acc_pos_1"] == pytest.approx(0.25) and r0["tau_estimate"] == pytest.approx(1.25)
    assert (r0["tokens"], r0["wait_s"], r0["step_s"], r0["steps"]) == (600.0, 3.0, 12.0, 3.0)


class CollectiveDevices(TorchDispatchMode):
    """Records the device of every tensor that enters a c10d collective (observes; the collective still runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.seen.append(
                (str(func), [t.device.type for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
            )
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank_group() -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_on_cuda_no_cpu_tensor_reaches_the_collective_and_steps_never_read_the_device(one_rank_group: Any) -> None:
    """The training device is "cuda" (fake tensors, no GPU needed): the steps queue no host read, the reduction is one
    all-reduce of a CUDA tensor."""
    # Under FakeTensorMode reading a device value on the host (.item(), float(), .tolist()) raises, so add() would fail
    # if it synced.
    with FakeTensorMode(), CollectiveDevices() as watch:
        metrics = StepMetrics(torch.device("cuda"))
        for step in range(5):
            metrics.add(_model_metrics("cuda", loss=1.0 + step, acc=0.5), tokens=10.0, wait_s=0.1, step_s=1.0)
        assert watch.seen == []
        reduced = metrics.reduced_on_device()
    assert reduced.device.type == "cuda"
    assert watch.seen == [("c10d.allreduce_.default", ["cuda"])]
    # The same watch sees a CPU tensor when one is passed: with cpu:gloo,cuda:nccl it would have gone to gloo.
    with FakeTensorMode(), CollectiveDevices() as watch:
        dist.all_reduce(torch.zeros(3))
    assert watch.seen == [("c10d.allreduce_.default", ["cpu"])]


def _row(sample_id: str, length: int, offset: int) -> Row:
    return Row(sample_id, np.arange(offset, offset + length, dtype=np.int64), np.ones(length, np.int64))


def test_the_feeder_packs_each_step_on_the_device_and_splits_the_states() -> None:
    steps = [Step(0, [_row("a", 3, 0), _row("b", 2, 10)]), Step(None, [_row("c", 4, 20)])]
    states = [
        [torch.full((3, 3, 2), 1.0, dtype=torch.bfloat16), torch.full((2, 3, 2), 2.0, dtype=torch.bfloat16)],
        [torch.arange(24, dtype=torch.bfloat16).reshape(4, 3, 2)],
    ]
    out = list(DeviceFeeder(iter(zip(steps, states)), torch.device("cpu"), torch.float32))
    assert [s.index for s, _ in out] == [0, None]
    assert out[0][0].sources == {
        "states_file": 0.0,
        "states_array": 0.0,
        "states_cache": 2.0,
    }  # tensors: what the cache gives
    first = out[0][1]
    assert first["input_ids"].tolist() == [[0, 1, 2, 10, 11]] and first["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert first["document_ids"].tolist() == [[0, 0, 0, 1, 1]] and first["loss_mask"].shape == (1, 5)
    assert (
        first["hidden_states"].shape == (1, 5, 4) and first["hidden_states"].dtype == torch.float32
    )  # aux layers, concatenated
    assert first["verifier_last_hidden_states"].shape == (1, 5, 2)  # the last layer
    assert first["hidden_states"][0, 3].tolist() == [2.0] * 4
    second = out[1][1]
    assert second["verifier_last_hidden_states"][0, :, 0].tolist() == [
        4.0,
        10.0,
        16.0,
        22.0,
    ]  # layer 2 of each token, not a copy of layer 0
    assert second["hidden_states"][0, 1].tolist() == [6.0, 7.0, 8.0, 9.0]


def test_a_failure_while_packing_reaches_the_training_thread() -> None:
    def broken() -> Any:
        yield Step(0, [_row("a", 3, 0)]), [torch.zeros(2, 2, 2)]  # states of 2 positions for 3 tokens

    with pytest.raises(AssertionError, match="states of a have 2 positions for 3 tokens"):
        list(DeviceFeeder(broken(), torch.device("cpu"), torch.float32))
