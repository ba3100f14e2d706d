"""Packed steps on the training device, one step ahead, off the training thread.

A background thread takes each step's rows and hidden states (from the
service or the cache, raypipe.train.states), packs them into one sequence in
host memory (pinned on GPU nodes), and starts an asynchronous host-to-device
copy on its own CUDA stream. The training thread waits only for that copy
(an event on its stream), never for a pageable copy or a pack, and splits the
states into the drafter's auxiliary layers and the last layer on the device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raypipe.serve.transport import copy_states, source_kind, states_dtype

if TYPE_CHECKING:
    from raypipe.train.rows import Row


@dataclass
class Step:
    """One worker's share of an optimizer step: its pack of rows (index None: a zero-weight filler pack)."""

    index: int | None
    rows: list[Row]
    sources: dict[str, float] = field(default_factory=dict)  # how its rows' states arrived: see state_sources


def state_sources(states: list[Any]) -> dict[str, float]:
    """Rows whose states came as a file on this node, as an object-store array (another node), or from the cache."""
    kinds = [source_kind(s) for s in states]
    return {f"states_{k}": float(kinds.count(k)) for k in ("file", "array", "cache")}


def pack_host(rows: list[Row], states: list[Any], pin: bool) -> dict[str, torch.Tensor]:
    """One packed sequence in host memory: rows end to end, positions restarting per row, states [T, n_layers, H].

    Each row's states are copied once, from wherever they arrived (a shared-memory
    file, an object-store array, a cached tensor), into the step's buffer.
    """
    for r, s in zip(rows, states, strict=True):
        assert s.shape[0] == len(r.input_ids), (
            f"states of {r.sample_id} have {s.shape[0]} positions for {len(r.input_ids)} tokens"
        )
    t = sum(len(r.input_ids) for r in rows)
    hidden = torch.empty((t, *states[0].shape[1:]), dtype=states_dtype(states[0]), pin_memory=pin)
    start = 0
    for s in states:
        copy_states(s, hidden[start : start + s.shape[0]])
        start += s.shape[0]

    def as_long(parts: list[np.ndarray]) -> torch.Tensor:
        out = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts), dtype=np.int64)).unsqueeze(0)
        return out.pin_memory() if pin else out

    return {
        "input_ids": as_long([r.input_ids for r in rows]),
        "loss_mask": as_long([r.loss_mask for r in rows]),
        "document_ids": as_long([np.full(len(r.input_ids), i) for i, r in enumerate(rows)]),
        "position_ids": as_long([np.arange(len(r.input_ids)) for r in rows]),
        "hidden": hidden,
    }


def drafter_inputs(packed: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's forward inputs from a packed sequence already on its device (the split copies on the device)."""
    hidden = packed["hidden"]
    t = hidden.shape[0]
    return {
        **{k: packed[k] for k in ("input_ids", "loss_mask", "document_ids", "position_ids")},
        "hidden_states": hidden[:, :-1, :].reshape(1, t, -1).to(dtype),
        "verifier_last_hidden_states": hidden[:, -1, :].reshape(1, t, -1).to(dtype),
    }


class DeviceFeeder:
    """Iterates (step, drafter inputs on `device`), packing and copying up to `depth` steps ahead on a thread."""

    def __init__(
        self, steps: Iterator[tuple[Step, list[Any]]], device: torch.device, dtype: torch.dtype, depth: int = 2
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self._queue: queue.Queue[tuple[Step, dict[str, torch.Tensor], Any] | BaseException | None] = queue.Queue(
            maxsize=depth
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(steps,), name="raypipe-device-feeder", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, steps: Iterator[tuple[Step, list[Any]]]) -> None:
        try:
            stream = torch.cuda.Stream(self.device) if self.cuda else None
            for step, states in steps:
                step.sources = state_sources(states)
                host = pack_host(step.rows, states, pin=self.cuda)
                if stream is None:
                    item = (step, host, None)
                else:
                    with torch.cuda.stream(stream):
                        on_device = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
                        copied = torch.cuda.Event()
                        copied.record(stream)
                    item = (step, on_device, copied)
                if not self._put(item):
                    return
            self._put(None)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(err)

    def __iter__(self) -> Iterator[tuple[Step, dict[str, torch.Tensor]]]:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                step, packed, copied = item
                if copied is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(copied)
                    for tensor in packed.values():
                        tensor.record_stream(current)  # allocated on the copy stream, used on this one
                yield step, drafter_inputs(packed, self.dtype)
        finally:
            self._stop.set()
