"""The published configs of the production targets, built in code (no weights, nothing downloaded).

They let tests and the GPU check derive what every stage would use at the
real shapes (layer ids, drafter size, bytes of hidden states, memory per GPU)
on machines that can never fetch the checkpoints. Values are those of the
checkpoints' `config.json` on the Hugging Face Hub.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig, Qwen3Config


def qwen3_8b() -> PretrainedConfig:
    """Qwen/Qwen3-8B: `Qwen3ForCausalLM`, 36 layers of full attention."""
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151_936,
        hidden_size=4096,
        intermediate_size=12_288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=151_643,
        eos_token_id=151_645,
        dtype="bfloat16",
    )


def qwen36_27b() -> PretrainedConfig:
    """Qwen/Qwen3.6-27B: `Qwen3_5ForConditionalGeneration`, a composite config; 64 text layers, 3 Gated DeltaNet to 1
    gated attention."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        architectures=["Qwen3_5ForConditionalGeneration"],
        text_config={
            "vocab_size": 248_320,
            "hidden_size": 5120,
            "intermediate_size": 17_408,
            "num_hidden_layers": 64,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "max_position_embeddings": 262_144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
            "bos_token_id": 248_044,
            "eos_token_id": 248_044,
            "dtype": "bfloat16",
        },
        vision_config={
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "out_hidden_size": 5120,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
        },
        image_token_id=248_056,
        video_token_id=248_057,
        vision_start_token_id=248_053,
        vision_end_token_id=248_054,
        tie_word_embeddings=False,
    )


PUBLISHED = {"Qwen/Qwen3-8B": qwen3_8b, "Qwen/Qwen3.6-27B": qwen36_27b}


def write_config_dir(model_id: str, directory: Path) -> Path:
    """`config.json` of a published target in `directory`: what `from_pretrained` reads, without weights."""
    PUBLISHED[model_id]().save_pretrained(directory)
    return directory
