"""Where a step's target hidden states come from: the service, a cache on fsspec, or both.

- online: every sequence is extracted by the service; nothing is stored.
- offline: every sequence must be in the cache (a miss is an error that names the fix).
- hybrid: a cache hit is used, a miss goes to the service and is stored when `store_misses`.

Service requests for the next steps are in flight while the current step
computes (the client's prefetch window); results come back in step order, as
the service sent them (raypipe.serve.transport: a file on this node, or an
array) or as cached tensors, and are copied once, into the step's buffer
(raypipe.train.batches). Cache entries are keyed by a hash of the token ids,
so a regenerated reply never reuses the states of another sequence. A cache
holds the states of one target (its name and digest: its weights, updated in
place or not), dtype and set of layers, recorded in its meta.json; any other is
refused.
"""

from __future__ import annotations

import hashlib
import io
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from raypipe.config import ServeConfig
from raypipe.serve.transport import as_tensor
from raypipe.storage import Storage
from raypipe.target import target_digest


class StateCache:
    """Hidden states [T, n_layers, H] (bf16) per token sequence, for one target (`serve`'s model, its digest and
    dtype) and one set of layers."""

    def __init__(self, storage: Storage, serve: ServeConfig, layer_ids: list[int]) -> None:
        self.storage = storage
        meta = {
            "target": serve.model,
            "target_digest": target_digest(serve),
            "dtype": serve.dtype,
            "layer_ids": list(layer_ids),
        }
        if storage.exists("meta.json"):
            found = storage.read_json("meta.json")
            if found != meta:
                raise ValueError(
                    f"train.states.cache {storage.url} holds states of {found}, not {meta}; point "
                    "train.states.cache at a new "
                    "directory"
                )
        else:
            storage.write_json("meta.json", meta)

    @staticmethod
    def _key(ids: np.ndarray) -> str:
        digest = hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()
        return f"{digest[:2]}/{digest[2:34]}.pt"

    def get(self, ids: np.ndarray) -> torch.Tensor | None:
        try:
            data = self.storage.read(self._key(ids))  # one request per lookup, not an exists() and a read
        except FileNotFoundError:
            return None
        return torch.load(io.BytesIO(data), weights_only=True)

    def put(self, ids: np.ndarray, states: torch.Tensor) -> None:
        buf = io.BytesIO()
        torch.save(states.to(torch.bfloat16).contiguous(), buf)
        self.storage.write(self._key(ids), buf.getvalue(), durable=False)  # one per sequence: no sync each


def stream_states(
    packs: Iterable[list[np.ndarray]],
    mode: str,
    client: Any | None,
    cache: StateCache | None,
    store_misses: bool = True,
) -> Iterator[list[Any]]:
    """States of each pack's sequences, pack by pack in order (copy them with raypipe.serve.transport.copy_states)."""
    if mode == "online":
        assert client is not None, "online mode needs the service"
        yield from client.stream([ids.tolist() for ids in seqs] for seqs in packs)
        return
    assert cache is not None, f"{mode} mode needs train.states.cache"
    if mode == "offline":
        for seqs in packs:
            hits = [cache.get(ids) for ids in seqs]
            if any(hit is None for hit in hits):
                raise ValueError(
                    f"train.states.cache {cache.storage.url} lacks the states of {sum(h is None for h in hits)} "
                    "sequences of a step; fill it with a hybrid run (train.states.mode=hybrid "
                    "train.states.store_misses=true) or train online"
                )
            yield hits
        return
    assert client is not None, "hybrid mode needs the service"
    pending: deque[tuple[list[np.ndarray], list[torch.Tensor | None]]] = deque()

    def misses() -> Iterator[list[list[int]]]:
        for seqs in packs:
            hits = [cache.get(ids) for ids in seqs]
            pending.append((seqs, hits))
            yield [ids.tolist() for ids, hit in zip(seqs, hits) if hit is None]

    for extracted in client.stream(misses()):
        seqs, hits = pending.popleft()
        fetched = iter(extracted)
        out = []
        for ids, hit in zip(seqs, hits):
            if hit is None:
                hit = next(fetched)
                if (
                    store_misses
                ):  # stored, and the step still copies from what was delivered (so its metrics say how states arrived)
                    cache.put(ids, as_tensor(hit, keep_file=True))
            out.append(hit)
        yield out
