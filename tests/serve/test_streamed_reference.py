"""The canary's streamed reference computes the whole model's states, bit for bit, on dense Qwen3 and the hybrid
Qwen3.6 (composite checkpoint), with no more than one decoder layer's weights in memory at any time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from raypipe.assets.tiny_target import build_tiny_target
from raypipe.serve.canary import CANARY_PROMPTS
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.streamed_reference import StreamedReference

PROMPTS = [list(p) for p in CANARY_PROMPTS]
# Every layer kind of each target, the embeddings (id 0) and the last layer's output.
LAYER_IDS = {"qwen3": (0, 1, 2, 4), "qwen36": (0, 1, 2, 3, 4, 5, 8)}


@pytest.fixture(scope="module", params=["qwen3", "qwen36"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, tuple[int, ...]]:
    """The session's tiny Qwen3 target, or a tiny Qwen3.6 one built here."""
    if request.param == "qwen3":
        return request.getfixturevalue("tiny_target"), LAYER_IDS["qwen3"]
    path = build_tiny_target(tmp_path_factory.mktemp("models") / "tiny_qwen36", arch="qwen36")
    return str(path), LAYER_IDS["qwen36"]


def test_the_streamed_states_equal_the_whole_models(target: tuple[str, tuple[int, ...]]) -> None:
    path, ids = target
    whole = TransformersEngine(path, ids, dtype="bfloat16").extract(PROMPTS)  # the canary's reference before
    streamed = StreamedReference(path, ids, dtype=torch.bfloat16).extract(PROMPTS)
    assert [s.shape for s in streamed] == [w.shape for w in whole]
    assert all(torch.equal(s, w) for s, w in zip(streamed, whole))


def test_one_decoder_layer_is_in_memory_at_a_time(target: tuple[str, tuple[int, ...]]) -> None:
    path, ids = target
    reference = StreamedReference(path, ids)

    def loaded() -> set[str]:
        return {name for name, p in reference.model.named_parameters() if not p.is_meta}

    final_norm = loaded()
    assert final_norm and all(name.endswith("norm.weight") and "layers" not in name for name in final_norm)
    seen: list[int] = []

    def check(index: int, prefix: str) -> Any:
        def hook(layer: torch.nn.Module, _inputs: Any) -> None:  # runs after the reference's own pre-hook
            layer_params = {f"{prefix}.{n}" for n, _ in layer.named_parameters()}
            assert loaded() == final_norm | layer_params, f"layer {index}: other weights in memory"
            seen.append(index)

        return hook

    names = {id(module): name for name, module in reference.model.named_modules()}
    for index, layer in enumerate(reference.layers):
        layer.register_forward_pre_hook(check(index, names[id(layer)]))
    reference.extract(PROMPTS)
    assert seen == list(range(len(reference.layers)))
    assert loaded() == final_norm  # every layer dropped; the embedding table and the LM head were never read
