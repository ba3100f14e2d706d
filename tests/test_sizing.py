"""The production recipes against the real shapes of their targets, built from the published configs (no weights).

Everything each stage derives from the target is computed here as the stage
computes it: layer ids, the vLLM options, the drafter (on the meta device),
bytes of hidden states per token, and memory per GPU against the GPUs of
cluster.yaml's node types.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from raypipe.assets.published import write_config_dir
from raypipe.config import load_config
from raypipe.serve.vllm_args import engine_args
from raypipe.sizing import fsdp_gather_bytes_per_checkpoint, fsdp_gather_bytes_per_step, size_run
from raypipe.target import resolve_target
from raypipe.train.drafter import drafter_on_meta

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {name: yaml.safe_load((ROOT / name).read_text()) for name in ("cluster.yaml", "cluster_separate.yaml")}
GPU_BYTES = {  # memory per GPU of cluster.yaml's instance types, as nvidia-smi reports it
    "g6e.12xlarge": 46_068 << 20,  # L40S
    "p5.48xlarge": 81_559 << 20,  # H100 SXM
    "p5e.48xlarge": 143_771 << 20,  # H200
    "p5en.48xlarge": 143_771 << 20,  # H200
}
KIB = 1024

SHAPES = {
    # recipe: (published target, layers, hidden, vocabulary, served layer ids, draft attention heads x head dim,
    # bytes of states per token)
    "qwen3_8b": ("Qwen/Qwen3-8B", 36, 4096, 151_936, (1, 9, 17, 25, 33, 36), (32, 128), 48 * KIB),
    "qwen36_27b": ("Qwen/Qwen3.6-27B", 64, 5120, 248_320, (1, 16, 31, 46, 61, 64), (20, 256), 60 * KIB),
}


def drafter_parameters(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, layers: int, aux: int
) -> int:
    """Trainable parameters of a DFlash drafter, counted by hand: Qwen3 decoder layers, the fc over the aux states,
    two norms."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim
    layer = attention + 3 * hidden * intermediate + 2 * hidden
    return layers * layer + aux * hidden * hidden + 2 * hidden


@pytest.mark.parametrize("recipe", sorted(SHAPES))
def test_each_stage_derives_the_real_shape(recipe: str, tmp_path: Path) -> None:
    model_id, layers, hidden, vocab, layer_ids, (heads, head_dim), state_bytes = SHAPES[recipe]
    directory = write_config_dir(model_id, tmp_path)
    cfg = load_config(recipe, [f"serve.model={directory}", "train.drafter.mask_token_id=151669"])
    config = AutoConfig.from_pretrained(directory)

    # The target as every stage reads it: dimensions from the text config, default DFlash layers.
    target = resolve_target(cfg.serve)
    assert (target.shape.num_layers, target.shape.hidden_size, target.shape.vocab_size) == (layers, hidden, vocab)
    assert target.layer_ids == layer_ids and target.shape.architecture == config.architectures[0]
    if recipe == "qwen36_27b":
        # The composite config has no top-level dimensions: reading them there was the AttributeError of
        # `build_drafter` (vocab_size) and `VllmEngine` (num_hidden_layers).
        assert not hasattr(config, "vocab_size") and not hasattr(config, "num_hidden_layers")
        assert target.shape.multimodal and target.shape.hybrid
        assert (
            target.shape.layer_types.count("full_attention") == 16 and target.shape.layer_types[3] == "full_attention"
        )

    # vLLM engines: no prefix caching (hybrid targets), text only for the vision tower.
    args = engine_args(target, cfg.serve)
    assert args["enable_prefix_caching"] is False and args["tensor_parallel_size"] == cfg.serve.tensor_parallel_size
    assert ("limit_mm_per_prompt" in args) == target.shape.multimodal

    # The drafter as the training stage builds it, on the meta device.
    drafter = drafter_on_meta(target, cfg.train)
    layer = drafter.config.transformer_layer_config
    assert (layer.hidden_size, layer.num_attention_heads, layer.head_dim, layer.vocab_size) == (
        hidden,
        heads,
        head_dim,
        vocab,
    )
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (heads * head_dim, hidden)
    assert list(drafter.config.aux_hidden_state_layer_ids) == list(layer_ids[:-1])
    assert drafter.fc.weight.shape == (hidden, hidden * (len(layer_ids) - 1))
    text = config.get_text_config()
    expected = drafter_parameters(
        hidden,
        heads,
        text.num_key_value_heads,
        head_dim,
        text.intermediate_size,
        cfg.train.drafter.draft_layers,
        len(layer_ids) - 1,
    )
    sizing = size_run(cfg, target, drafter)
    print(recipe, sizing.summary())
    assert sizing.drafter_trainable == expected
    # embedding, the LM head (the drafter's and its targets' one tensor), the target's final norm; replicated
    assert drafter.verifier_lm_head.weight is drafter.lm_head.weight
    assert sizing.drafter_frozen == 2 * vocab * hidden + hidden
    shards = cfg.train.run.num_workers if cfg.train.run.strategy == "fsdp2" else 1
    assert sizing.train_static_per_gpu == expected * 16 // shards + sizing.drafter_frozen * 2

    # FSDP2's all-gathers (bf16): issue 39 took the frozen matrices out, three of them before the heads were shared.
    frozen_before = 3 * vocab * hidden + hidden
    layers = expected - (len(layer_ids) - 1) * hidden * hidden - 2 * hidden  # the fc and two norms are the root's
    root = expected - layers
    before = fsdp_gather_bytes_per_step(layers, root, frozen_before, frozen_sharded=True)
    after = fsdp_gather_bytes_per_step(layers, root, sizing.drafter_frozen, frozen_sharded=False)
    assert after == 2 * (2 * layers + root)  # each layer gathered for the forward and again for the backward
    assert before - after == 2 * frozen_before
    assert after / before < {"qwen3_8b": 0.52, "qwen36_27b": 0.48}[recipe]
    assert fsdp_gather_bytes_per_checkpoint(expected, frozen_before, frozen_sharded=True) == (
        12 * expected + 2 * frozen_before
    )
    assert fsdp_gather_bytes_per_checkpoint(expected, sizing.drafter_frozen, frozen_sharded=False) == 12 * expected
    assert sizing.state_bytes_per_token == state_bytes

    # Memory per GPU against the GPUs each cluster layout gives each stage.
    for layout, cluster in LAYOUTS.items():
        types = cluster["available_node_types"].values()
        [serve_node] = [t for t in types if cfg.serve.resource in t["resources"]]
        [train_node] = [t for t in types if cfg.train.run.resource in t["resources"]]
        serve_gpu, train_gpu = (
            GPU_BYTES[serve_node["node_config"]["InstanceType"]],
            GPU_BYTES[train_node["node_config"]["InstanceType"]],
        )
        assert sizing.serve_bytes_per_gpu <= cfg.serve.gpu_memory_utilization * serve_gpu, (
            layout,
            sizing.summary(),
            serve_gpu,
        )
        assert sizing.train_bytes_per_gpu <= 0.8 * train_gpu, (
            layout,
            sizing.summary(),
            train_gpu,
        )  # room for activations and the allocator
