"""A tiny Qwen3-architecture target model, built in code so tests and CPU runs never download one.

It has Qwen3's real vocabulary and tokenizer, so token ids, chat templates and
hidden-state shapes behave as with a production Qwen3 target, at a size that
runs a forward pass on one CPU core in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from raypipe.assets.qwen_vocab import build_qwen_tokenizer, write_dir_atomically

# Bump whenever the built model changes, so stale directories are refused instead of reused.
TINY_TARGET_VERSION = "2"

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
        bos_token_id=151_643,
        eos_token_id=151_645,
        dtype="float32",
    )


def build_tiny_target(output_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny target (fp32 safetensors + Qwen tokenizer) to `output_dir` once; later calls reuse it.

    The directory appears atomically, so concurrent builders and interrupted runs
    never leave a half-written model behind.
    """
    out = Path(output_dir).expanduser()
    stamp = {"version": TINY_TARGET_VERSION, "seed": seed}
    found = _read_stamp(out)
    if found is None:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty and holds no tiny target; pass a new or empty directory")
        write_dir_atomically(out, lambda tmp: _write(tmp, stamp))
        found = _read_stamp(out)
    if found != stamp:
        raise ValueError(f"{out} holds a tiny target built with {found}, not {stamp}; remove it or pass the seed it was built with")
    return out


def _read_stamp(out: Path) -> dict | None:
    path = out / _STAMP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _write(directory: Path, stamp: dict) -> None:
    """Initialise from the seed without disturbing the caller's RNG, then save model, tokenizer and stamp."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stamp["seed"])
        model = Qwen3ForCausalLM(tiny_target_config())
    model.save_pretrained(directory)
    build_qwen_tokenizer().save_pretrained(directory)
    (directory / _STAMP_FILE).write_text(json.dumps(stamp))
