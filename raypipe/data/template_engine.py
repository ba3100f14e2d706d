"""Chat-template engines: transformers' Jinja, the reference, and MiniJinja, compiled, used once shown equal.

Rendering with transformers' sandboxed Jinja costs as much as a third of the
data stage. MiniJinja (the Rust engine, `minijinja` on PyPI) renders the same
templates several times faster, but it is another implementation of the
language: printed floats, missing filters or a method it lacks would change
the text, and with it the tokens and the masks. So identical output is the
contract, checked, never assumed:
- once per run, on the driver, the template is rendered by both engines on PROBES, a set of
  conversations that takes every branch of the Qwen/ChatML family's templates
  (system turns, tools and their schemas, tool calls with dict and string
  arguments, tool results, reasoning as a field and inside <think>, weights
  of odd JSON values, no user query, each with and without the generation
  prompt). A template MiniJinja cannot compile, or renders differently on
  any probe (text or refusal), is rendered by Jinja for the whole run, and
  `choose_engine` says why. The verdict travels to the actors in the
  tokenizer spec (`build_engine`), so they neither re-run the probes nor
  import transformers (and torch) unless a row needs Jinja;
- any conversation MiniJinja fails on is rendered again by Jinja, so a refusal
  carries Jinja's own reason and a template error never depends on the engine;
  so is any text holding U+FFFD, which is what MiniJinja makes of a lone
  surrogate (Rust strings cannot hold one; Jinja passes it on, and the
  tokenizer stage rejects the row, naming it);
- tests/data/test_fast_path.py compares both on random conversations
  for every built-in template.
Templates with `{% generation %}` markers (a transformers extension) are
always rendered by Jinja.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError

from raypipe.compat.transformers import speed_up_chat_template_sandbox
from raypipe.data.formats import Reject

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
Messages = list[dict[str, Any]]


class JinjaEngine:
    """transformers' own rendering (its sandbox made cheaper, raypipe.compat.transformers): the reference."""

    name = "jinja"

    def __init__(self, template: str, kwargs: dict[str, Any]) -> None:
        self.template = template
        self.kwargs = kwargs
        speed_up_chat_template_sandbox(template)

    def render_with_markers(self, messages: Messages, tools: Any, gen_prompt: bool, markers: bool) -> tuple[str, list]:
        """(text, the character spans of `{% generation %}` blocks when `markers`); raises Reject."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, indices = render_jinja_template(
                [messages],
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=gen_prompt,
                return_assistant_tokens_mask=markers,
                **self.kwargs,
            )
        except TemplateError as err:
            raise Reject("render", "template_error", f"template refused the conversation: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise Reject("render", "template_error", f"template failed: {type(err).__name__}: {err}") from None
        return texts[0], indices[0] if markers else []

    def render(self, messages: Messages, tools: Any, gen_prompt: bool) -> str:
        return self.render_with_markers(messages, tools, gen_prompt, False)[0]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' `tojson` (json.dumps, non-ASCII kept), not MiniJinja's HTML-escaping one."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class MiniJinjaEngine:
    """The template compiled by MiniJinja with transformers' settings (trim_blocks, lstrip_blocks, Python-style
    methods) and globals (raise_exception, tojson, strftime_now). A conversation it fails on goes to Jinja, built
    on first use."""

    name = "minijinja"

    def __init__(self, template: str, kwargs: dict[str, Any], fallback: JinjaEngine | None = None) -> None:
        import minijinja

        self.template = template
        self.kwargs = kwargs
        self._fallback = fallback
        self.env = minijinja.Environment(templates={"chat": template})
        self.env.pycompat = True
        self.env.trim_blocks = True
        self.env.lstrip_blocks = True
        self.env.add_function("raise_exception", _raise_exception)
        self.env.add_function("strftime_now", _strftime_now)
        self.env.add_filter("tojson", _tojson)
        self.env.undeclared_variables_in_template("chat")  # compiles it: a syntax MiniJinja lacks raises here

    def render_own(self, messages: Messages, tools: Any, gen_prompt: bool) -> str:
        """MiniJinja's text alone, without the fallback; raises what MiniJinja raises."""
        return self.env.render_template(
            "chat", messages=messages, tools=tools, add_generation_prompt=gen_prompt, **self.kwargs
        )

    @property
    def fallback(self) -> JinjaEngine:
        if self._fallback is None:
            self._fallback = JinjaEngine(self.template, self.kwargs)
        return self._fallback

    def render(self, messages: Messages, tools: Any, gen_prompt: bool) -> str:
        try:
            text = self.render_own(messages, tools, gen_prompt)
        except Exception:  # noqa: BLE001 - Jinja renders it, or refuses it with its own reason
            return self.fallback.render(messages, tools, gen_prompt)
        if "\ufffd" in text:  # MiniJinja replaces text Rust cannot hold (lone surrogates); Jinja keeps it as it is
            return self.fallback.render(messages, tools, gen_prompt)
        return text


@dataclass(frozen=True)
class EngineChoice:
    engine: JinjaEngine | MiniJinjaEngine
    note: str  # which engine renders the template, and why


def build_engine(template: str, kwargs: dict[str, Any], name: str) -> JinjaEngine | MiniJinjaEngine:
    """The engine `choose_engine` chose (by its name), without the probes: for actors, given the driver's verdict."""
    return MiniJinjaEngine(template, kwargs) if name == MiniJinjaEngine.name else JinjaEngine(template, kwargs)


def _outcome(engine: Any, messages: Messages, tools: Any, gen_prompt: bool) -> str:
    """The text, or the fact of a refusal: what an engine must agree on with the reference."""
    try:
        if isinstance(engine, MiniJinjaEngine):  # without its fallback: its own rendering is on trial
            return engine.render_own(messages, tools, gen_prompt)
        return engine.render(messages, tools, gen_prompt)
    except Exception:  # noqa: BLE001 - a refusal, by either engine
        return "<refused>"


def choose_engine(template: str, kwargs: dict[str, Any]) -> EngineChoice:
    """MiniJinja where it renders every probe exactly as Jinja does, else Jinja, with the reason."""
    jinja = JinjaEngine(template, kwargs)
    if GENERATION_TAG.search(template):
        return EngineChoice(jinja, "Jinja: the template has {% generation %} blocks, which only transformers renders")
    try:
        mini = MiniJinjaEngine(template, kwargs, jinja)
    except Exception as err:  # noqa: BLE001 - any compile error means Jinja renders it
        return EngineChoice(jinja, f"Jinja: MiniJinja cannot compile the template ({' '.join(str(err).split())})")
    for i, (messages, tools) in enumerate(PROBES):
        for gen_prompt in (False, True):
            want, got = _outcome(jinja, messages, tools, gen_prompt), _outcome(mini, messages, tools, gen_prompt)
            if want != got:
                at = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                return EngineChoice(
                    jinja,
                    f"Jinja: MiniJinja renders probe {i} (add_generation_prompt={gen_prompt}) differently at "
                    f"character {at}: {want[at : at + 40]!r} vs {got[at : at + 40]!r}",
                )
    return EngineChoice(mini, f"MiniJinja: renders all {2 * len(PROBES)} probe renders exactly as Jinja")


_JSON_ODDITIES = {"float": 1e-07, "whole": 1.0, "big": 10**30, "flag": True, "none": None, "text": "é <b> & 'q' \"dq\""}
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <for> a city & its 'area'; ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "default": 3}},
                "required": ["city"],
                "extra": _JSON_ODDITIES,
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {}}},
]
_CALL = {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
_ODD_CALL = {"type": "function", "function": {"name": "noop", "arguments": dict(_JSON_ODDITIES, nested={"a": [1, {}]})}}
_STRING_CALL = {"type": "function", "function": {"name": "noop", "arguments": '{"raw": "string arguments"}'}}


def _m(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


# Conversations, each with tools or None: every branch of the ChatML / Qwen3.x family of templates.
PROBES: list[tuple[Messages, Any]] = [
    ([_m("user", "Hello")], None),
    ([_m("system", "Be brief."), _m("user", "Hi"), _m("assistant", "Hello!")], None),
    ([_m("user", "  padded  \n"), _m("assistant", "\n\nleading newlines"), _m("user", ""), _m("assistant", "")], None),
    (
        [
            _m("user", "First"),
            _m("assistant", "Early answer", reasoning_content="\nearly thoughts\n"),
            _m("user", "Second"),
            _m("assistant", "<think>\ninline thoughts\n</think>\n\nLate answer"),
        ],
        None,
    ),
    ([_m("user", "Q"), _m("assistant", "A", reasoning_content="only reasoning on the last turn")], None),
    ([_m("user", "Q"), _m("assistant", "no think tag</think>after")], None),
    (
        [
            _m("system", "Use tools."),
            _m("user", "Weather in Paris?"),
            _m("assistant", "", tool_calls=[_CALL, _ODD_CALL]),
            _m("tool", '{"temp": 20}', tool_call_id="call_1"),
            _m("tool", "second result"),
            _m("assistant", "It is 20 degrees."),
        ],
        _TOOLS,
    ),
    (
        [
            _m("user", "Call it"),
            _m("assistant", "Calling now.", tool_calls=[_STRING_CALL]),
            _m("tool", "done"),
            _m("user", "<tool_response>\nnot a query\n</tool_response>"),
            _m("assistant", "Finished."),
        ],
        _TOOLS,
    ),
    ([_m("user", "With tools, no system"), _m("assistant", "ok")], _TOOLS),
    ([_m("system", "Only a system turn")], None),
    ([_m("assistant", "A reply before any query"), _m("user", "Now a query")], None),
    ([_m("user", "ünïcödé ✓ 中文 \t tabs"), _m("system", "a later system turn"), _m("assistant", "ok")], None),
]
