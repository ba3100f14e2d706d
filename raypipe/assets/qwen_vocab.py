"""A real Qwen2/Qwen3 tokenizer, built offline from the BPE ranks that ship inside the `dashscope` package.

Ids match Qwen's own tokenizer, so tests and tiny targets see the token boundaries
(and the BPE merges across template text) that production Qwen models see.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, normalizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from raypipe.assets.templates import load_template

# Bump whenever the built tokenizer changes, so cached copies are rebuilt.
VOCAB_VERSION = "1"

NUM_BPE_RANKS = 151_643

# Qwen2's pre-tokenizer: like GPT-4's, but digits are split one by one.
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# Qwen3's added tokens in id order from 151643, with Qwen3's `special` flag.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


# Qwen3's tokenizer settings, shared by the builder and the loader.
_TOKENIZER_KWARGS: dict[str, Any] = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "unk_token": None,
    "model_max_length": 131_072,
    "clean_up_tokenization_spaces": False,
}


def cache_root() -> Path:
    """Where built assets are cached: `$RAYPIPE_CACHE`, else `~/.cache/raypipe`."""
    return Path(os.environ.get("RAYPIPE_CACHE", "~/.cache/raypipe")).expanduser()


def qwen_vocab_path() -> Path:
    """Locate `qwen.tiktoken` without importing dashscope (that takes ~0.5 s and loads its HTTP clients)."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the Qwen vocabulary comes from the `dashscope` package; install it: pip install dashscope")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall dashscope: pip install --force-reinstall dashscope")
    return path


def write_dir_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Fill a temp sibling of `target` with `write`, then rename it into place.

    Readers never see a half-written directory, and when processes race the first
    rename wins and the others discard their copies.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def qwen_tokenizer_dir() -> Path:
    """The cached tokenizer directory (built on first use), for `AutoTokenizer.from_pretrained` in Ray actors."""
    vocab = qwen_vocab_path()
    template = load_template("qwen_strict")
    key = hashlib.sha256()
    for part in (vocab.read_bytes(), VOCAB_VERSION.encode(), template.encode()):
        key.update(hashlib.sha256(part).digest())
    target = cache_root() / "tokenizers" / f"qwen3-{key.hexdigest()[:16]}"
    if not target.is_dir():
        write_dir_atomically(target, lambda tmp: _build(vocab, template).save_pretrained(tmp))
    return target


def build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen3's tokenizer with the strict Qwen chat template, loaded from the cache (a fresh object per call).

    Loads `tokenizer.json` directly: `from_pretrained` parses it twice and deep-copies
    the result, which triples the load time of this 151K-token vocabulary.
    """
    directory = qwen_tokenizer_dir()
    return PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        name_or_path=str(directory),
        chat_template=load_template("qwen_strict"),
        **_TOKENIZER_KWARGS,
    )


class _QwenTikTokenConverter(TikTokenConverter):
    """TikTokenConverter that reads the ranks itself, so the `tiktoken` package is not needed."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        ranks = {}
        for line in Path(tiktoken_url).read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        if sorted(ranks.values()) != list(range(NUM_BPE_RANKS)):
            raise ValueError(f"{tiktoken_url} does not hold Qwen's {NUM_BPE_RANKS} BPE ranks; reinstall dashscope")
        return ranks


def _build(vocab: Path, chat_template: str) -> PreTrainedTokenizerFast:
    """Convert the ranks into Qwen2's fast-tokenizer pipeline (NFC, Qwen regex, byte-level BPE)."""
    backend = _QwenTikTokenConverter(str(vocab), pattern=QWEN_PRETOKENIZE_REGEX).converted()
    # The rest of the pipeline as in Qwen's own tokenizer.json.
    backend.normalizer = normalizers.NFC()
    backend.model.ignore_merges = False
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert backend.token_to_id(content) == NUM_BPE_RANKS + offset, content
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template, **_TOKENIZER_KWARGS)
