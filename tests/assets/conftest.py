"""The Qwen tokenizer built into the session's private asset cache (tests/conftest.py)."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from raypipe.assets.qwen_vocab import build_qwen_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer(raypipe_cache: Path) -> PreTrainedTokenizerFast:
    return build_qwen_tokenizer()
