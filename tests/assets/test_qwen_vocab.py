"""The offline Qwen tokenizer: ids pinned to real Qwen, special tokens, and the on-disk cache."""

import importlib.util
import time
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from raypipe.assets import qwen_vocab
from raypipe.assets.qwen_vocab import (
    QWEN3_ADDED_TOKENS,
    build_qwen_tokenizer,
    qwen_tokenizer_dir,
    write_dir_atomically,
)
from raypipe.assets.templates import load_template

# Ids as Qwen2/Qwen3's published tokenizer produces them.
PINNED = [
    ("Hello world", [9707, 1879]),
    ("<|im_start|>user\n", [151644, 872, 198]),
    ("<|im_start|>assistant\n", [151644, 77091, 198]),
    ("<|im_start|>system\n", [151644, 8948, 198]),
    ("<think>\n\n</think>\n\n", [151667, 271, 151668, 271]),
    ("2024", [17, 15, 17, 19]),  # Qwen splits digits one by one
    ("你好", [108386]),
]


@pytest.mark.parametrize(("text", "ids"), PINNED)
def test_encodings_match_qwen(qwen_tokenizer: PreTrainedTokenizerFast, text: str, ids: list[int]) -> None:
    assert qwen_tokenizer.encode(text, add_special_tokens=False) == ids


def test_added_tokens_sit_at_qwen3_ids(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    expected = {content: 151643 + offset for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    assert len(expected) == 26
    assert {t: qwen_tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert expected["<|im_end|>"] == 151645 and expected["</think>"] == 151668
    assert len(qwen_tokenizer) == 151669


def test_special_flags_follow_qwen3(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    decoder = qwen_tokenizer.added_tokens_decoder
    assert decoder[151644].special and decoder[151656].special  # <|im_start|>, <|video_pad|>
    assert not decoder[151657].special and not decoder[151667].special  # <tool_call>, <think>
    ids = qwen_tokenizer.encode("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False)
    assert qwen_tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_special_tokens_stay_atomic(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = qwen_tokenizer.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[-1] == 151645
    assert ids[1:-1] == qwen_tokenizer.encode("user\nHi", add_special_tokens=False)
    glued = qwen_tokenizer.encode("x<tool_call>y</tool_call>z", add_special_tokens=False)
    assert 151657 in glued and 151658 in glued


def test_named_tokens(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    assert qwen_tokenizer.eos_token == "<|im_end|>" and qwen_tokenizer.eos_token_id == 151645
    assert qwen_tokenizer.pad_token == "<|endoftext|>" and qwen_tokenizer.pad_token_id == 151643
    assert qwen_tokenizer.bos_token is None
    assert qwen_tokenizer.encode("Hi") == qwen_tokenizer.encode("Hi", add_special_tokens=False)


def test_chat_template_is_the_strict_one(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    assert qwen_tokenizer.chat_template == load_template("qwen_strict")


@pytest.mark.parametrize(
    "text", ["naïve café 🤖🚀", "中文测试：你好，世界！", "  two  spaces\n\n\ttab", "x = [1, 2]\n"]
)
def test_byte_level_round_trip(qwen_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert qwen_tokenizer.decode(qwen_tokenizer.encode(text, add_special_tokens=False)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=64))
def test_any_text_round_trips_up_to_nfc(qwen_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert qwen_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_input_is_nfc_normalised(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    assert qwen_tokenizer.encode("cafe\u0301") == qwen_tokenizer.encode("caf\u00e9")


def test_second_call_loads_from_cache(monkeypatch: pytest.MonkeyPatch, qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    directory = qwen_tokenizer_dir()
    monkeypatch.setattr(qwen_vocab, "_build", lambda *_: pytest.fail("rebuilt despite a cached copy"))
    start = time.perf_counter()
    tokenizer = build_qwen_tokenizer()
    elapsed = time.perf_counter() - start
    assert qwen_tokenizer_dir() == directory
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer is not qwen_tokenizer  # callers may mutate their copy
    assert elapsed < 2.0  # about 0.6 s on a 2-core CI box; a rebuild takes several seconds


def test_cache_lives_under_raypipe_cache(raypipe_cache: Path) -> None:
    directory = qwen_tokenizer_dir()
    assert directory.parent == raypipe_cache / "tokenizers"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in directory.iterdir()}
    assert [p for p in directory.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_cache_key_includes_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = qwen_tokenizer_dir()
    monkeypatch.setattr(qwen_vocab, "VOCAB_VERSION", "test-bump")
    monkeypatch.setattr(qwen_vocab, "_build", lambda *_: _FakeTokenizer())
    after = qwen_tokenizer_dir()
    assert after != before and (after / "fake.txt").is_file()


def test_auto_tokenizer_agrees_with_loader(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    """Ray actors use AutoTokenizer on the cached dir; it must match build_qwen_tokenizer()."""
    auto = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    text = "<|im_start|>user\nHello world 2024 你好<|im_end|>\n<think>\n\n</think>\n\n<tool_call>"
    assert auto.encode(text) == qwen_tokenizer.encode(text)
    assert auto.chat_template == qwen_tokenizer.chat_template
    assert (auto.eos_token, auto.pad_token, auto.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_missing_dashscope_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install dashscope"):
        qwen_vocab.qwen_vocab_path()


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    def fail(directory: Path) -> None:
        (directory / "half.txt").write_text("x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_dir_atomically(tmp_path / "out", fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_loses_a_race_gracefully(tmp_path: Path) -> None:
    target = tmp_path / "out"

    def race(directory: Path) -> None:
        target.mkdir()
        (target / "winner.txt").write_text("first")
        (directory / "loser.txt").write_text("second")

    write_dir_atomically(target, race)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["winner.txt"]


class _FakeTokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "fake.txt").write_text("fake")
