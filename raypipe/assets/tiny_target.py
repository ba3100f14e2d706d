"""Tiny random targets of the production architectures, built in code so tests and CPU runs never download one.

- `qwen3`: Qwen3 (`Qwen3ForCausalLM`), Qwen3-8B's architecture.
- `qwen36`: Qwen3.6 (`Qwen3_5ForConditionalGeneration`), Qwen3.6-27B's: a
  composite config (`text_config` + `vision_config`), its layer pattern (three
  Gated DeltaNet `linear_attention` layers, then a gated `full_attention` one)
  twice, a one-layer vision tower, the vocabulary padded to Qwen3.6's 248,320
  rows. Eight layers, not four: DFlash's default taps five auxiliary layers, as
  on the 27B, and a 5-layer drafter's attention layers stay in one vLLM KV cache
  group (vLLM groups a hybrid model's layers by the smaller of its attention and
  Gated DeltaNet layer counts, and refuses draft layers split across groups:
  with one full-attention target layer, 1 + 5 attention layers against 3 Gated
  DeltaNet ones are split; the 27B's 16 + 5 against 48 are not). Like Qwen's
  base checkpoints its config and tokenizer name `<|endoftext|>` as eos: only
  the template (and generation_config.json) say that a turn ends with `<|im_end|>`.

Both have Qwen's real vocabulary and tokenizer (with raypipe's strict
Qwen-style template), so token ids, templates and hidden-state shapes behave as
with a production target, at a size that runs on one CPU core in milliseconds.
Sizes are the smallest vLLM's CPU kernels accept: attention head dim 32, and
Gated DeltaNet key/value head dim 128 (the CPU kernel refuses 32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig, Qwen3Config

from raypipe.assets.qwen_vocab import build_qwen_tokenizer, write_dir_atomically

# Bump whenever the built model changes, so stale directories are refused instead of reused.
TINY_TARGET_VERSION = "4"
ENDOFTEXT, IM_END = 151_643, 151_645

_STAMP_FILE = "raypipe_tiny_target.json"


def tiny_target_config() -> Qwen3Config:
    """Qwen3's shape rules and token ids at toy width (vocabulary padded to 151936 as in Qwen3)."""
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention supports
        intermediate_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=ENDOFTEXT,
        eos_token_id=IM_END,
        dtype="float32",
    )


def qwen36_config(text: dict[str, Any], media_token_ids: tuple[int, int, int, int]) -> PretrainedConfig:
    """Qwen3.6-27B's composite config at toy width: its layer pattern (three Gated DeltaNet layers, then a gated full
    attention one), its rope (partial rotary 0.25 with the real config's M-RoPE section and interleaving keys, theta
    1e7), no tied embeddings, a one-layer vision tower as the composite config needs; `text` sets the rest (vocabulary,
    layers, widths, token ids). Head dims are the smallest vLLM's CPU kernels take: attention 32 (8 rotated dims),
    Gated DeltaNet 128 (the CPU kernel refuses 32). `media_token_ids`: image, video, vision start and end."""
    from transformers import Qwen3_5Config

    image, video, start, end = media_token_ids
    return Qwen3_5Config(
        text_config={
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
            "dtype": "float32",
            **text,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "num_position_embeddings": 64,
        },
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )


def tiny_qwen36_config() -> PretrainedConfig:
    """Qwen3.6's architecture with Qwen's vocabulary (padded to 248,320 rows) and token ids, the pattern twice."""
    return qwen36_config(
        {
            "vocab_size": 248_320,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
            "max_position_embeddings": 4096,
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": ENDOFTEXT,
        },
        (151_655, 151_656, 151_652, 151_653),
    )


ARCHITECTURES = ("qwen3", "qwen36")


def build_tiny_target(output_dir: str | os.PathLike[str], seed: int = 0, arch: str = "qwen3") -> Path:
    """Write the tiny `arch` target (fp32 safetensors + Qwen tokenizer) to `output_dir` once; later calls reuse it.

    The directory appears atomically, so concurrent builders and interrupted runs
    never leave a half-written model behind.
    """
    out = Path(output_dir).expanduser()
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny target architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    stamp = {"version": TINY_TARGET_VERSION, "seed": seed, "arch": arch}
    found = _read_stamp(out)
    if found is None:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty and holds no tiny target; pass a new or empty directory")
        write_dir_atomically(out, lambda tmp: _write(tmp, stamp))
        found = _read_stamp(out)
    if found != stamp:
        raise ValueError(
            f"{out} holds a tiny target built with {found}, not {stamp}; remove it or pass the seed it was built with"
        )
    return out


def _read_stamp(out: Path) -> dict[str, Any] | None:
    path = out / _STAMP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _write(directory: Path, stamp: dict[str, Any]) -> None:
    """Initialise from the seed without disturbing the caller's RNG, then save model, tokenizer and stamp."""
    tokenizer = build_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stamp["seed"])
        if stamp["arch"] == "qwen3":
            from transformers import Qwen3ForCausalLM

            model = Qwen3ForCausalLM(tiny_target_config())
        else:
            from transformers import Qwen3_5ForConditionalGeneration

            model = Qwen3_5ForConditionalGeneration(tiny_qwen36_config())
            model.generation_config = GenerationConfig(
                bos_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=ENDOFTEXT
            )
            tokenizer.eos_token = "<|endoftext|>"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / _STAMP_FILE).write_text(json.dumps(stamp))
