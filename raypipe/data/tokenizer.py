"""Resolve the configured tokenizer and template once, on the driver.

Workers get a `TokenizerSpec` (the tokenizer's JSON, the template and its
variables) instead of a model id, so every actor on every node uses exactly
the bytes the driver hashed into the manifest, and nothing is fetched twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.assets.templates import TEMPLATE_NAMES, load_template
from raypipe.config import DataConfig, fingerprint
from raypipe.data import incremental
from raypipe.data.template_engine import choose_engine

if TYPE_CHECKING:  # transformers (and torch) load only on the driver; actors need just the spec
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_json: str  # the fast tokenizer, serialized
    chat_template: str
    template_kwargs: dict[str, Any]  # special tokens and enable_thinking, as apply_chat_template passes them
    end_of_turn: str  # the token that closes an assistant turn (data.end_of_turn, else probed from the template)
    end_of_turn_id: int
    reserved: tuple[str, ...]  # special tokens content must not contain
    template_engine: str  # the renderer `choose_engine` verified for this template (its output is the same either way)
    template_engine_note: str  # which, and why
    incremental_prompt: str | None  # the generation prompt if incremental.verify proved one render per conversation
    incremental_note: str  # whether it did, and why not

    def digest(self) -> str:
        return fingerprint(
            [
                self.tokenizer_json,
                self.chat_template,
                self.template_kwargs,
                self.end_of_turn,
                self.end_of_turn_id,
                list(self.reserved),
            ]
        )

    def template_digest(self) -> str:
        return fingerprint(self.chat_template)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """`data.tokenizer`: the builtin Qwen vocabulary, the demo target's, a builtin target's (raypipe.target) or a path /
    Hugging Face id."""
    if name == "builtin:qwen":
        from raypipe.assets.qwen_vocab import build_qwen_tokenizer

        return build_qwen_tokenizer()
    if name == "builtin:demo":
        from raypipe.assets.demo_target import build_tokenizer

        return build_tokenizer()  # the demo target's own vocabulary, without training the target
    from transformers import AutoTokenizer

    from raypipe.target import resolve_model, tokenizer_path

    tok = AutoTokenizer.from_pretrained(tokenizer_path(resolve_model(name, key="data.tokenizer")))
    if not tok.is_fast:
        raise ValueError(f"data.tokenizer: {name} has no fast tokenizer; raypipe needs tokenizer.json")
    return tok


def resolve_template(tok: PreTrainedTokenizerBase, chat_template: str | None, tokenizer_name: str) -> str:
    if chat_template is None:
        if not tok.chat_template:
            raise ValueError(
                f"data.chat_template: tokenizer {tokenizer_name} has no chat template; set one of "
                f"{', '.join(TEMPLATE_NAMES)} or a .jinja path"
            )
        return tok.chat_template
    if chat_template in TEMPLATE_NAMES:
        return load_template(chat_template)
    return Path(chat_template).read_text()


PROBE_REPLY = "raypipe probe reply"


def probe_end_of_turn(
    tok: PreTrainedTokenizerBase, template: str, template_kwargs: dict[str, Any], specials: tuple[str, ...]
) -> str:
    """The special token the template writes right after an assistant reply (e.g. `<|im_end|>`).

    The tokenizer's eos is no guide: Qwen's base checkpoints name `<|endoftext|>`,
    while their template ends every turn with `<|im_end|>`.
    """
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE_REPLY}]
    try:
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **template_kwargs)
    except Exception as err:  # noqa: BLE001 - any template error means the probe cannot tell
        raise ValueError(
            f"data.end_of_turn: the template cannot render a probe conversation ({err}); set data.end_of_turn"
        ) from None
    tail = text[text.find(PROBE_REPLY) + len(PROBE_REPLY) :] if PROBE_REPLY in text else ""
    found = sorted((tail.find(t), t) for t in specials if t in tail)
    if not found or tail[: found[0][0]].strip():
        raise ValueError(
            f"data.end_of_turn: the template writes {tail[:40]!r} after a reply, not a special token; set "
            "data.end_of_turn to the token that ends a turn"
        )
    return found[0][1]


def resolve_tokenizer(cfg: DataConfig) -> tuple[PreTrainedTokenizerBase, TokenizerSpec]:
    tok = load_tokenizer(cfg.tokenizer)
    template = resolve_template(tok, cfg.chat_template, cfg.tokenizer)
    reserved = tuple(sorted(t.content for t in tok.added_tokens_decoder.values() if t.special))
    template_kwargs = {**tok.special_tokens_map, "enable_thinking": cfg.enable_thinking}
    end_of_turn = cfg.end_of_turn or probe_end_of_turn(tok, template, template_kwargs, reserved)
    end_of_turn_ids = tok.encode(end_of_turn, add_special_tokens=False)
    if end_of_turn not in reserved or len(end_of_turn_ids) != 1:
        raise ValueError(
            f"data.end_of_turn: {end_of_turn!r} is not one special token of {cfg.tokenizer}; special tokens: "
            f"{', '.join(reserved)}"
        )
    engine = choose_engine(template, template_kwargs)
    prompt, prompt_note = incremental.verify(template, template_kwargs, engine.engine.name)
    spec = TokenizerSpec(
        tokenizer_json=tok.backend_tokenizer.to_str(),
        chat_template=template,
        template_kwargs=template_kwargs,
        end_of_turn=end_of_turn,
        end_of_turn_id=end_of_turn_ids[0],
        reserved=reserved,
        template_engine=engine.engine.name,
        template_engine_note=engine.note,
        incremental_prompt=prompt,
        incremental_note=prompt_note,
    )
    tok.chat_template = template
    return tok, spec
