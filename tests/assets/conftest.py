"""Shared fixtures: a private asset cache per test session, and one tokenizer built into it."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from raypipe.assets.qwen_vocab import build_qwen_tokenizer


@pytest.fixture(scope="session", autouse=True)
def raypipe_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep tests off the user's ~/.cache/raypipe, so they exercise the cold build too."""
    root = tmp_path_factory.mktemp("raypipe_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYPIPE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def qwen_tokenizer(raypipe_cache: Path) -> PreTrainedTokenizerFast:
    return build_qwen_tokenizer()
