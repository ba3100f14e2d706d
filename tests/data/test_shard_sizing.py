"""Shard sizes come from the input size and the actor count, within data.chunk_bytes."""

from __future__ import annotations

from raypipe.data.pipeline import MIN_SHARD_BYTES, SHARDS_PER_ACTOR, shard_bytes
from tests.helpers import data_config


def test_a_small_input_is_split_so_every_actor_gets_shards() -> None:
    cfg = data_config(num_actors=2, chunk_bytes=64 << 20)
    size = shard_bytes(cfg, 40 << 20)
    assert (40 << 20) / size >= SHARDS_PER_ACTOR * 2 - 1 and size < cfg.chunk_bytes


def test_a_large_input_uses_chunk_bytes_and_a_tiny_one_the_floor() -> None:
    cfg = data_config(num_actors=2, chunk_bytes=8 << 20)
    assert shard_bytes(cfg, 10 << 30) == 8 << 20
    assert shard_bytes(cfg, 1000) == MIN_SHARD_BYTES
    assert shard_bytes(data_config(num_actors=2, chunk_bytes=4096), 10 << 20) == 4096  # a smaller setting is kept
