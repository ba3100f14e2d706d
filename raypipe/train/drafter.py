"""The DFlash drafter for any Hugging Face target: speculators' model, the format vLLM loads.

Shape (hidden size, heads, head dim, rope, norms, vocabulary) comes from the
target's config; the number of draft layers and the block size from
`train.*`; composite targets (Qwen3.6) contribute their text config. The
drafter reads the auxiliary target layers (the served layer ids but the
last; raypipe's ids are vLLM's and speculators' convention) and
takes its targets from the last one through the target's own final norm and
LM head. Embedding and LM head are copied from the target and frozen; the
drafter's head and the head of its targets are one tensor (`share_verifier_head`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import AutoTokenizer

from raypipe.config import TrainConfig
from raypipe.target import Target, tokenizer_path
from raypipe.train.vocab import DraftVocab


def attention_implementation(cfg: TrainConfig) -> str:
    """Flex attention on GPU; sdpa on CPU, where flex attention has no backward."""
    if cfg.run.attention != "auto":
        return cfg.run.attention
    return "simple_flex_attention" if cfg.run.use_gpu else "sdpa"


def loss_implementation(cfg: TrainConfig) -> str:
    """speculators' fused loss needs Triton (GPU); the eager one runs anywhere."""
    return "fused" if cfg.run.use_gpu else "eager"


def resolve_mask_token_id(target: str, explicit: int | None, vocab_size: int) -> int:
    """The explicit id, else the tokenizer's mask token, else the first embedding row no token uses."""
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise ValueError(
                f"train.drafter.mask_token_id={explicit} is outside the target's vocabulary [0, {vocab_size})"
            )
        return explicit
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(target))
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise ValueError(
        f"{target} has no mask token and no unused embedding row; set train.drafter.mask_token_id to an id the "
        "drafter may use "
        "as mask"
    )


def aux_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The drafter's auxiliary layers: the served ids but the last, which must be the target's last layer."""
    if layer_ids[-1] != num_layers or len(layer_ids) < 2:
        raise ValueError(
            f"serve.layer_ids must end with the target's last layer ({num_layers}) after at least one auxiliary layer, "
            f"got {layer_ids}"
        )
    return list(layer_ids[:-1])


def drafter_config(target: Target, cfg: TrainConfig) -> Any:
    """speculators' DFlash config for the target: its text config's shape, `train.*`'s layers and block."""
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.train.cli import create_transformer_layer_config

    from raypipe.compat.speculators import build_base_config_kwargs

    layer_config = create_transformer_layer_config(  # reads the text config of composite targets
        verifier_name_or_path=target.path,
        num_layers=cfg.drafter.draft_layers,
        draft_arch="qwen3",
        hidden_act=None,
        sliding_window=cfg.schedule.step_tokens,
        full_attention_indices=list(range(cfg.drafter.draft_layers)),  # DFlash: full attention in every draft layer
    )
    # Qwen3.5/3.6 rotate with M-RoPE, which equals RoPE on text. The drafter trains with plain RoPE (its layers
    # ignore mrope_*), and vLLM refuses a drafter whose config names M-RoPE (speculators issue 570).
    layer_config.rope_parameters = {
        k: v for k, v in (layer_config.rope_parameters or {}).items() if not k.startswith("mrope")
    }
    # What from_training_args does, minus reading weights.
    kwargs = build_base_config_kwargs(
        layer_config,
        verifier_name_or_path=target.path,
        draft_vocab_size=cfg.drafter.draft_vocab_size or target.shape.vocab_size,
        block_size=cfg.drafter.block_size,
        target_layer_ids=aux_layer_ids(list(target.layer_ids), target.shape.num_layers),
        mask_token_id=resolve_mask_token_id(target.path, cfg.drafter.mask_token_id, target.shape.vocab_size),
        draft_attn_impl=attention_implementation(cfg),
        # Training attends bidirectionally inside a block in full-attention layers; vLLM reads this flag
        # as "non-causal" for every layer, so it must be set or vLLM drafts with a causal mask.
        sliding_window_non_causal=True,
    )
    return DFlashSpeculatorConfig(**kwargs)


def build_drafter(target: Target, cfg: TrainConfig, vocab: DraftVocab | None) -> Any:
    """A freshly initialised drafter (seeded by train.schedule.seed) with the target's embedding and LM head, frozen;
    with a draft vocabulary (raypipe.train.vocab) the LM head keeps the target's rows of its tokens."""
    from speculators.models.dflash import DFlashDraftModel

    config = drafter_config(target, cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.schedule.seed)
        model = DFlashDraftModel(config=config)
    if vocab is not None:
        model.load_vocab_mappings(vocab.t2d, vocab.d2t)
    model.load_verifier_weights()
    assert torch.equal(model.lm_head.weight, model.verifier_lm_head.weight), "speculators loads both from the target"
    share_verifier_head(model)
    return model


def share_verifier_head(model: Any) -> None:
    """`verifier_lm_head` made `lm_head`'s parameter: one tensor where speculators keeps two equal copies.

    Both are the target's LM head, frozen (with a draft vocabulary, both its rows of the draft tokens): the forward
    takes the targets from verifier_lm_head and the logits from lm_head, so loss and metrics do not change. The copy
    is the size of the target's head on every training GPU (2.5 GB at Qwen3.6-27B's shape, bf16). Checkpoints do not
    change either: speculators never saves verifier_lm_head (it rebuilds it from the target on load).
    """
    model.verifier_lm_head.weight = model.lm_head.weight


def drafter_on_meta(target: Target, cfg: TrainConfig) -> Any:
    """The drafter's modules on the meta device: shapes and parameter counts at any size, no weights read or
    allocated."""
    from speculators.models.dflash import DFlashDraftModel

    config = drafter_config(target, cfg)
    with torch.device("meta"):
        model = DFlashDraftModel(config=config)
    share_verifier_head(model)
    return model


def step_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """The loss settings passed to the drafter's forward (the model owns loss and metrics); each step adds its pack's
    `max_anchors` (raypipe.train.anchors.anchor_count)."""
    from speculators.losses import resolve_loss_config

    spec = cfg.objective.loss if isinstance(cfg.objective.loss, str) else json.dumps(cfg.objective.loss)
    return {
        "loss_config": resolve_loss_config(spec, loss_implementation(cfg)),
        "per_position_loss_weight": "dpace" if cfg.objective.position_weighting == "dpace" else "fixed-exp-decay",
        "dpace_alpha": cfg.objective.dpace_alpha,
        "gamma": cfg.objective.loss_decay_gamma,
    }
