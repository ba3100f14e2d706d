"""What a run needs per GPU, from the target's config and the drafter built on the meta device.

Estimates, not measurements: they tell before anything starts whether a
recipe can fit the GPUs it asks for, with formulas stated here. vLLM engines
on CPU are checked against the machine's memory instead (raypipe.node_memory).

Service replica (vLLM, bf16, tensor parallel `tp`):
- weights: target parameters x 2 bytes / tp;
- per cached token: K and V of every full-attention layer (2 x kv_heads x
  head_dim x 2 bytes) / tp, plus the hidden states that `extract_hidden_states`
  keeps per token (layer ids x hidden x 2 bytes, not sharded);
- per sequence, hybrid targets: each Gated DeltaNet layer's recurrent state
  (value heads x key dim x value dim, fp32) and convolution state / tp;
- it fits when weights + one engine call of `serve.max_batch_tokens` tokens +
  recurrent states of `serve.max_sequences` sequences stay within
  `gpu_memory_utilization` of the GPU.

Training worker (bf16 autocast, AdamW):
- trainable parameters: fp32 weights, gradients and two Adam moments, 16 bytes each;
- frozen parameters (the target's embedding and heads): bf16, 2 bytes each;
- both divided by the workers under FSDP2 (replicated under DDP);
- per step: the pack's hidden states (step_tokens x layer ids x hidden x
  2 bytes) and the logits of every drafted position (max_pack_anchors x block_size
  x draft vocabulary) for the drafter and the target, bf16, plus their fp32 copy in
  the loss: 8 bytes per logit, an upper bound (the fused loss works in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raypipe.config import RaypipeConfig
from raypipe.target import Target

GIB = 1 << 30


def target_parameters(target: Target) -> int:
    """Parameters of the target's language model, counted on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target.path))
    return sum(p.numel() for p in model.parameters())


def _cache_bytes(target: Target, tp: int) -> tuple[int, int]:
    """(bytes per cached token, bytes of recurrent state per sequence) on one GPU of a replica."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(target.path).get_text_config()
    kinds = target.shape.layer_types
    full = sum(1 for t in kinds if t in ("full_attention", "sliding_attention"))
    kv_per_token = full * 2 * text.num_key_value_heads * text.head_dim * 2 // tp
    per_token = kv_per_token + target.shape.state_bytes_per_token(len(target.layer_ids))
    linear = len(kinds) - full
    if not linear:
        return per_token, 0
    conv_dim = (
        2 * text.linear_num_key_heads * text.linear_key_head_dim
        + text.linear_num_value_heads * text.linear_value_head_dim
    )
    recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    conv = conv_dim * (text.linear_conv_kernel_dim - 1) * 2
    return per_token, linear * (recurrent + conv) // tp


@dataclass(frozen=True)
class Sizing:
    state_bytes_per_token: int  # hidden states served per token (bf16)
    target_parameters: int
    serve_weights_per_gpu: int
    serve_cache_per_token: int
    serve_state_per_sequence: int
    serve_bytes_per_gpu: int  # weights + one engine call + recurrent states of max_sequences
    drafter_trainable: int
    drafter_frozen: int
    train_static_per_gpu: int  # parameters, gradients, optimizer
    train_step_per_gpu: int  # one step's states and logits
    train_bytes_per_gpu: int

    def summary(self) -> dict[str, Any]:
        return {
            k: (round(v / GIB, 2) if k.endswith(("per_gpu", "per_sequence")) else v) for k, v in self.__dict__.items()
        }


def size_run(cfg: RaypipeConfig, target: Target, drafter: torch.nn.Module) -> Sizing:
    """Every figure above for `cfg` on `target`, with `drafter` (on the meta device) as the training stage builds it."""
    tp = cfg.serve.tensor_parallel_size
    params = target_parameters(target)
    per_token, per_sequence = _cache_bytes(target, tp)
    serve = params * 2 // tp + cfg.serve.max_batch_tokens * per_token + cfg.serve.max_sequences * per_sequence
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    shards = cfg.train.run.num_workers if cfg.train.run.strategy == "fsdp2" else 1
    static = (trainable * 16 + frozen * 2) // shards
    states = cfg.train.schedule.step_tokens * target.shape.state_bytes_per_token(len(target.layer_ids))
    draft_vocab = cfg.train.drafter.draft_vocab_size or target.shape.vocab_size
    logits = cfg.train.objective.max_pack_anchors * cfg.train.drafter.block_size * draft_vocab * 8
    return Sizing(
        state_bytes_per_token=target.shape.state_bytes_per_token(len(target.layer_ids)),
        target_parameters=params,
        serve_weights_per_gpu=params * 2 // tp,
        serve_cache_per_token=per_token,
        serve_state_per_sequence=per_sequence,
        serve_bytes_per_gpu=serve,
        drafter_trainable=trainable,
        drafter_frozen=frozen,
        train_static_per_gpu=static,
        train_step_per_gpu=states + logits,
        train_bytes_per_gpu=static + states + logits,
    )
