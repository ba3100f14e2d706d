"""Resolve the configured tokenizer and template once, on the driver.

Workers get a `TokenizerSpec` (the tokenizer's JSON, the template and its
variables) instead of a model id, so every actor on every node uses exactly
the bytes the driver hashed into the manifest, and nothing is fetched twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.assets.templates import TEMPLATE_NAMES, load_template
from raypipe.config import DataConfig

if TYPE_CHECKING:  # transformers (and torch) load only on the driver; actors need just the spec
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_json: str  # the fast tokenizer, serialized
    chat_template: str
    template_kwargs: dict[str, Any]  # special tokens and enable_thinking, as apply_chat_template passes them
    end_of_turn: str  # the token that closes an assistant turn (the tokenizer's eos)
    reserved: tuple[str, ...]  # special tokens content must not contain

    def digest(self) -> str:
        blob = json.dumps([self.tokenizer_json, self.chat_template, self.template_kwargs, self.end_of_turn, self.reserved], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def template_digest(self) -> str:
        return hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    if name == "builtin:qwen":
        from raypipe.assets.qwen_vocab import build_qwen_tokenizer

        return build_qwen_tokenizer()
    if name == "builtin:demo":
        from raypipe.assets.demo_target import build_tokenizer

        return build_tokenizer()  # the demo target's own vocabulary, without training the target
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if not tok.is_fast:
        raise ValueError(f"data.tokenizer: {name} has no fast tokenizer; raypipe needs tokenizer.json")
    return tok


def resolve_template(tok: PreTrainedTokenizerBase, chat_template: str | None, tokenizer_name: str) -> str:
    if chat_template is None:
        if not tok.chat_template:
            raise ValueError(f"data.chat_template: tokenizer {tokenizer_name} has no chat template; set one of {', '.join(TEMPLATE_NAMES)} or a .jinja path")
        return tok.chat_template
    if chat_template in TEMPLATE_NAMES:
        return load_template(chat_template)
    return Path(chat_template).read_text()


def resolve_tokenizer(cfg: DataConfig) -> tuple[PreTrainedTokenizerBase, TokenizerSpec]:
    tok = load_tokenizer(cfg.tokenizer)
    template = resolve_template(tok, cfg.chat_template, cfg.tokenizer)
    if not tok.eos_token:
        raise ValueError(f"data.tokenizer: {cfg.tokenizer} has no eos token to end assistant turns")
    reserved = tuple(sorted(t.content for t in tok.added_tokens_decoder.values() if t.special))
    spec = TokenizerSpec(
        tokenizer_json=tok.backend_tokenizer.to_str(),
        chat_template=template,
        template_kwargs={**tok.special_tokens_map, "enable_thinking": cfg.enable_thinking},
        end_of_turn=tok.eos_token,
        reserved=reserved,
    )
    tok.chat_template = template
    return tok, spec
