"""The tiny Qwen3 target: built in code, deterministic, idempotent, and loadable like a real checkpoint."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from raypipe.assets.templates import load_template
from raypipe.assets.tiny_target import build_tiny_target


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_target: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def model(tiny_target: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_target)


def test_loads_and_runs_a_forward_pass(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    batch = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    tokens = batch["input_ids"].shape[1]
    assert out.logits.shape == (1, tokens, 151936)
    assert len(out.hidden_states) == 5 and out.hidden_states[0].shape == (1, tokens, 64)
    assert torch.isfinite(out.logits).all()


def test_config_is_qwen3_shaped(model: PreTrainedModel) -> None:
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151936, 64, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert (config.intermediate_size, config.max_position_embeddings) == (128, 4096)
    assert config.tie_word_embeddings is False
    assert config.eos_token_id == 151645


def test_saved_as_fp32_safetensors_with_strict_template(tiny_target: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    with safe_open(tiny_target / "model.safetensors", framework="pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"F32"}
    assert tokenizer.chat_template == load_template("qwen_strict")


def test_second_build_is_skipped(tiny_target: Path) -> None:
    before = (tiny_target / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_target(tiny_target, seed=0) == tiny_target
    assert (tiny_target / "model.safetensors").stat().st_mtime_ns == before


def test_seed_determines_weights_and_spares_caller_rng(tiny_target: Path, tmp_path: Path) -> None:
    (tmp_path / "same").mkdir()  # an empty directory is filled like a missing one
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    same = build_tiny_target(tmp_path / "same", seed=0)
    other = build_tiny_target(tmp_path / "other", seed=1)
    assert torch.equal(torch.rand(3), expected_draw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "same"]  # no temp dirs left
    reference = (tiny_target / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == reference
    assert (other / "model.safetensors").read_bytes() != reference


def test_other_seed_in_built_dir_is_refused(tiny_target: Path) -> None:
    with pytest.raises(ValueError, match="pass the seed it was built with"):
        build_tiny_target(tiny_target, seed=7)


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_target(tmp_path)


@pytest.fixture(scope="module")
def tiny_qwen36(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny_qwen36", arch="qwen36")


def test_qwen36_is_the_composite_hybrid_architecture(tiny_qwen36: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_qwen36)
    text = config.get_text_config()
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"] and config.vision_config.depth == 1
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers) == (248_320, 128, 8)
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (text.head_dim, text.linear_key_head_dim, text.linear_value_head_dim) == (
        32,
        128,
        128,
    )  # vLLM's CPU kernels' smallest sizes
    with safe_open(tiny_qwen36 / "model.safetensors", "pt") as f:
        assert any(k.startswith("model.visual.") for k in f.keys())  # the vision tower is in the checkpoint
    # Like Qwen's base checkpoints, config and tokenizer name <|endoftext|> as eos; generation_config adds <|im_end|>.
    assert text.eos_token_id == 151_643 and AutoTokenizer.from_pretrained(tiny_qwen36).eos_token == "<|endoftext|>"
    assert GenerationConfig.from_pretrained(tiny_qwen36).eos_token_id == [151_645, 151_643]


def test_qwen36_loads_as_its_language_model_and_runs(tiny_qwen36: Path) -> None:
    from raypipe.serve.hf_engine import decoder_parts

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen36)
    _, embeddings, layers = decoder_parts(model)
    assert (
        type(model).__name__ == "Qwen3_5ForCausalLM" and len(layers) == 8 and embeddings.weight.shape == (248_320, 128)
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[9707, 1879, 11]])).logits
    assert logits.shape == (1, 3, 248_320) and torch.isfinite(logits).all()


def test_an_architecture_other_than_the_built_one_is_refused(tiny_target: Path) -> None:
    with pytest.raises(ValueError, match="built with"):
        build_tiny_target(tiny_target, arch="qwen36")
