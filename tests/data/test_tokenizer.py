"""The end-of-turn token comes from the template (or data.end_of_turn), never from the tokenizer's eos alone."""

from __future__ import annotations

import pytest

from raypipe.assets.qwen_vocab import build_qwen_tokenizer
from raypipe.assets.templates import load_template
from raypipe.data.tokenizer import probe_end_of_turn, resolve_tokenizer
from tests.helpers import data_config

RESERVED = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")


def test_the_probe_finds_the_token_that_ends_a_turn_even_when_eos_is_another() -> None:
    tok = build_qwen_tokenizer()
    tok.eos_token = "<|endoftext|>"  # as Qwen's base checkpoints (and the tiny Qwen3.6 target) declare it
    kwargs = {**tok.special_tokens_map, "enable_thinking": False}
    for template in ("qwen_strict", "chatml", "generation_markers"):
        assert probe_end_of_turn(tok, load_template(template), kwargs, RESERVED) == "<|im_end|>", template


def test_the_resolved_spec_carries_the_token_and_its_id() -> None:
    _, spec = resolve_tokenizer(data_config())
    assert (spec.end_of_turn, spec.end_of_turn_id) == ("<|im_end|>", 151_645)
    _, spec = resolve_tokenizer(data_config(end_of_turn="<|endoftext|>"))  # an explicit setting wins
    assert (spec.end_of_turn, spec.end_of_turn_id) == ("<|endoftext|>", 151_643)


def test_a_template_without_a_special_token_after_replies_asks_for_the_setting() -> None:
    tok = build_qwen_tokenizer()
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"data.end_of_turn: the template writes '\\n' after a reply"):
        probe_end_of_turn(tok, plain, {}, RESERVED)


def test_an_end_of_turn_that_is_not_one_special_token_is_refused() -> None:
    with pytest.raises(ValueError, match="data.end_of_turn: 'END' is not one special token"):
        resolve_tokenizer(data_config(end_of_turn="END"))
