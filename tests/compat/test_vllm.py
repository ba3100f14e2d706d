"""vLLM 0.32's private and runner-internal functions that the serving contract calls through raypipe.compat.vllm,
on small DFlash drafter configs (no engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from transformers import Qwen3Config

from raypipe.compat.vllm import aux_layer_ids, layer_attention, parallel_drafting_token_id


def drafter_config(dflash_config: dict[str, Any], **fields: Any) -> Qwen3Config:
    config = Qwen3Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=100, **fields
    )
    config.dflash_config = dflash_config
    return config


@pytest.fixture
def current_vllm_config() -> Iterator[None]:
    """vLLM's attention resolution reads the current vLLM config, as the contract sets it."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


def test_layer_attention_full_is_non_causal_sliding_is_causal_and_mixed_is_refused(current_vllm_config) -> None:
    full = drafter_config({})  # what raypipe exports: full attention in every draft layer
    assert [layer_attention(full, i) for i in range(2)] == [(None, False), (None, False)]
    sliding = drafter_config({}, layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=16)
    assert [layer_attention(sliding, i) for i in range(2)] == [(16, True), (16, True)]
    mixed = drafter_config({}, layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    with pytest.raises(NotImplementedError, match="mixed sliding/full attention"):
        layer_attention(mixed, 0)


def test_aux_layer_ids_are_the_dflash_target_layers_plus_one() -> None:
    assert aux_layer_ids(drafter_config({"target_layer_ids": [0, 2]})) == [1, 3]
    assert aux_layer_ids(drafter_config({})) == []


def test_the_parallel_drafting_token_is_the_dflash_mask_token_or_none() -> None:
    assert parallel_drafting_token_id(drafter_config({"mask_token_id": 5})) == 5
    assert parallel_drafting_token_id(drafter_config({"mask_token_id": None})) is None  # vLLM raises TypeError
    assert parallel_drafting_token_id(drafter_config({})) is None  # vLLM raises ValueError
