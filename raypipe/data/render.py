"""Chat template -> text cut at every supervised boundary.

The assistant mask is defined by what the serving engine sees: the prompt is
rendered with the generation prompt, then the model emits its reply through
the end-of-turn token on its own. So for each assistant turn we render its
own prefix (`add_generation_prompt=True`) and the conversation through that
turn, and supervise exactly the text between the two, up to and including
the end-of-turn token. Templates with `{% generation %}` markers are used as
written (the result equals transformers' `return_assistant_tokens_mask`).

When the full render does not extend every turn's own render (a template
that rewrites history, e.g. Qwen3 dropping earlier reasoning), "render once"
would train on text the engine never sees; such samples fall back to one row
per supervised assistant turn.

Every string that reaches the template is screened for the tokenizer's
special tokens (content, reasoning, tool names, call ids, every key and value
of tool-call arguments and of the tools schemas): one spelled out in data
would become a real control token, e.g. end the supervised turn early or
forge a system turn. After rendering, each supervised span must hold exactly
one end-of-turn token, its last. Assistant turns with OpenAI's `weight: 0`
are rendered as context and never supervised.

The output is a list of pieces (text, supervised) per row: tokenizing each
piece separately keeps BPE from merging a token across a mask boundary.

When `incremental.verify` proved that the template renders every prefix of a
conversation as a prefix of the whole, the row and every turn's boundaries come
from one render of the template marked at each message (`_segment_incremental`):
one render per conversation, linear in its turns, instead of two per turn.

A prompt-only conversation (the common case) is rendered once, with the
generation prompt; the placeholder's rendered form is appended as the
template renders it after a reference prompt. That text is never trained on
and is replaced by the target's reply before training, so the second render
per row that would only confirm it is not spent.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any

from raypipe.data import incremental
from raypipe.data.formats import Conversation, Reject
from raypipe.data.template_engine import GENERATION_TAG, build_engine, choose_engine

if TYPE_CHECKING:
    from raypipe.data.tokenizer import TokenizerSpec


@dataclass
class Segmented:
    """One output row before tokenization."""

    pieces: list[tuple[str, bool]]  # (text, supervised), concatenating to the rendered row
    prompt_pieces: int  # leading pieces up to the end of the last generation prompt
    needs_response: bool  # ends in the placeholder reply, to be regenerated
    turn: int | None  # message index of a per-turn row's assistant turn, None for a render-once row


@dataclass
class _Turn:
    index: int  # message index
    start: int  # char offset where the generation prompt ends
    end: int  # char offset just after the end-of-turn token
    text: str  # render of the conversation through this turn
    supervised: bool


class ChatRenderer:
    """Renders conversations with one template; pure, no tokenizer calls."""

    def __init__(
        self,
        chat_template: str,
        template_kwargs: dict[str, Any],
        end_of_turn: str,
        placeholder: str,
        reserved: list[str],
        engine: str | None = None,
        generation_prompt: str | None = None,
    ) -> None:
        """`engine` and `generation_prompt`: the driver's verdicts on this template (`choose_engine`'s engine; the
        generation prompt if `incremental.verify` proved one render per conversation enough, else None). With
        `engine` None, both are reached here."""
        self.eot = end_of_turn
        self.placeholder = placeholder
        # special tokens that no content may spell out: they would tokenize as control tokens
        self.reserved = re.compile("|".join(map(re.escape, sorted(reserved, key=len, reverse=True))) or "(?!)")
        self.raw_reserved = _raw_screen(reserved)
        if engine is None:
            self.engine = choose_engine(chat_template, template_kwargs).engine
            generation_prompt = incremental.verify(chat_template, template_kwargs, self.engine.name)[0]
        else:
            self.engine = build_engine(chat_template, template_kwargs, engine)
        self.generation_prompt = generation_prompt
        self.marked = None
        if generation_prompt is not None:
            marked_kwargs = {**template_kwargs, incremental.MARK_VAR: incremental.MARK}
            self.marked = build_engine(incremental.mark_turns(chat_template), marked_kwargs, self.engine.name)
        self.has_markers = bool(GENERATION_TAG.search(chat_template))
        self.placeholder_tail = self._placeholder_tail()

    @classmethod
    def of(cls, spec: TokenizerSpec, placeholder: str) -> ChatRenderer:
        """The renderer of a resolved tokenizer's template (its engine as the driver chose it), special tokens
        reserved."""
        return cls(
            spec.chat_template,
            spec.template_kwargs,
            spec.end_of_turn,
            placeholder,
            list(spec.reserved),
            spec.template_engine,
            spec.incremental_prompt,
        )

    def _placeholder_tail(self) -> str | None:
        """How the template renders the placeholder reply after a generation prompt; None if it does not extend it."""
        user = {"role": "user", "content": "Hello"}
        try:
            prompt = self._render([user], None, True)
            full = self._render([user, {"role": "assistant", "content": self.placeholder}], None, False)
        except Reject:
            return None
        return full[len(prompt) :] if full.startswith(prompt) and self.placeholder in full[len(prompt) :] else None

    def _render(self, messages: list[dict[str, Any]], tools: Any, gen_prompt: bool) -> str:
        return self.engine.render(messages, tools, gen_prompt)

    def _refuse_specials(self, value: Any, code: str, where: str) -> None:
        for text in _strings(value):
            found = self.reserved.search(text)
            if found:
                raise Reject("normalize", code, f"{where} contains the special token {found.group()}")

    def _check_reserved(self, conv: Conversation) -> None:
        """No string the template renders may spell a special token."""
        for i, msg in enumerate(conv.messages):
            for key in ("content", "reasoning_content"):
                self._refuse_specials(msg.get(key), "special_token_in_content", f"messages[{i}].{key}")
            for key in ("tool_calls", "tool_call_id"):
                self._refuse_specials(msg.get(key), "special_token_in_tool_call", f"messages[{i}].{key}")
        self._refuse_specials(conv.tools, "special_token_in_tools", "tools")

    def spells_no_special(self, line: bytes) -> bool:
        """No string of this JSON line can spell a special token: none appears in its bytes, and the line has no
        escape (\\u, \\/) that could write one. Cheaper than walking every string; when False, `segment` checks."""
        return (
            self.raw_reserved is not None
            and b"\\u" not in line
            and b"\\/" not in line
            and not self.raw_reserved.search(line)
        )

    def segment(self, conv: Conversation, screened: bool = False) -> list[Segmented]:
        """Conversation -> rows of pieces; raises Reject with the reason. `screened`: its JSON line passed
        `spells_no_special`, so the strings need no check."""
        messages = list(conv.messages)
        if not screened:
            self._check_reserved(conv)
        needs_response = messages[-1]["role"] != "assistant"
        if needs_response and self.placeholder_tail and not any(m["role"] == "assistant" for m in messages):
            prompt = self._render(messages, conv.tools, True)
            return [Segmented([(prompt, False), (self.placeholder_tail, False)], 1, True, None)]
        if needs_response:
            messages.append({"role": "assistant", "content": self.placeholder})
        if self.has_markers:
            return [self._segment_markers(messages, conv.tools, needs_response, conv.context_only)]
        if self.marked is not None and messages[0]["role"] != "assistant":  # the proof covers prefixes of 1 or more
            row = self._segment_incremental(messages, conv.tools, needs_response, conv.context_only)
            if row is not None:
                return [row]
        full = self._render(messages, conv.tools, False)
        turns = self._turns(messages, conv.tools, full, needs_response, conv.context_only)
        if all(full.startswith(t.text[: t.end]) for t in turns):
            return [_cut(full, turns, needs_response, None, self.eot)]
        last = len(messages) - 1
        placeholder = [needs_response and t.index == last for t in turns]
        return [
            _cut(t.text, [t], p, t.index, self.eot)
            for t, p in zip(turns, placeholder, strict=True)
            if t.supervised or p
        ]

    def _turns(
        self, messages: list[dict[str, Any]], tools: Any, full: str, needs_response: bool, context_only: frozenset[int]
    ) -> list[_Turn]:
        """Each assistant turn whose prompt the template can render; leading ones it cannot are context."""
        last = len(messages) - 1
        turns = []
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            try:
                prefix = self._render(messages[:k], tools, True)
            except Reject:
                if k == last:
                    raise Reject(
                        "render",
                        "no_generation_prompt",
                        "template cannot render a generation prompt for the final turn",
                    ) from None
                continue  # e.g. an assistant turn before any user query: kept as context only
            through = full if k == last else self._render(messages[: k + 1], tools, False)
            if not through.startswith(prefix):
                raise _does_not_extend(k)
            end = through.rfind(
                self.eot, len(prefix)
            )  # the turn's own closing token; _cut refuses a span holding another
            if end < 0:
                raise _no_end_of_turn(k, self.eot)
            turns.append(
                _Turn(
                    k,
                    len(prefix),
                    end + len(self.eot),
                    through,
                    not (needs_response and k == last) and k not in context_only,
                )
            )
        _require_supervision(turns, needs_response)
        return turns

    def _segment_incremental(
        self, messages: list[dict[str, Any]], tools: Any, needs_response: bool, context_only: frozenset[int]
    ) -> Segmented | None:
        """The render-once row from one render of the marked template: messages[:k] renders as the text before
        message k's mark, with the generation prompt as that text plus the prompt, so each turn's prompt and text
        are slices of it, and the checks of `_turns` are made on the slices. None when the data holds a mark."""
        assert self.marked is not None and self.generation_prompt is not None
        cut = incremental.cut_marks(self.marked.render(messages, tools, False), len(messages))
        if cut is None:
            return None
        full, offsets = cut
        last = len(messages) - 1
        turns = []
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            if not full.startswith(self.generation_prompt, offsets[k], offsets[k + 1]):
                raise _does_not_extend(k)
            start = offsets[k] + len(self.generation_prompt)
            end = full.rfind(self.eot, start, offsets[k + 1])
            if end < 0:
                raise _no_end_of_turn(k, self.eot)
            supervised = not (needs_response and k == last) and k not in context_only
            turns.append(_Turn(k, start, end + len(self.eot), full, supervised))
        _require_supervision(turns, needs_response)
        return _cut(full, turns, needs_response, None, self.eot)

    def _segment_markers(
        self, messages: list[dict[str, Any]], tools: Any, needs_response: bool, context_only: frozenset[int]
    ) -> Segmented:
        full, blocks = self.engine.render_with_markers(messages, tools, False, markers=True)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if len(blocks) != len(assistant):
            raise Reject(
                "render",
                "generation_blocks",
                f"template marked {len(blocks)} generation blocks for {len(assistant)} assistant turns",
            )
        turns = [_Turn(k, s, e, full, k not in context_only) for k, (s, e) in zip(assistant, blocks, strict=True)]
        turns[-1].supervised = turns[-1].supervised and not needs_response
        _require_supervision(turns, needs_response)
        return _cut(full, turns, needs_response, None, self.eot)


def _does_not_extend(k: int) -> Reject:
    return Reject(
        "render",
        "turn_does_not_extend_prompt",
        f"messages[{k}] does not render as a continuation of its generation prompt "
        "(reasoning on a turn while enable_thinking is false?)",
    )


def _no_end_of_turn(k: int, eot: str) -> Reject:
    return Reject("render", "no_end_of_turn", f"messages[{k}] renders without the end-of-turn token {eot}")


def _require_supervision(turns: list[_Turn], needs_response: bool) -> None:
    if not any(t.supervised for t in turns) and not needs_response:
        raise Reject(
            "render",
            "no_supervised_turn",
            "no assistant turn is supervised: each has weight 0 or no prompt the template can render",
        )


def _raw_screen(reserved: list[str]) -> re.Pattern[bytes] | None:
    """The special tokens as a pattern over raw JSON bytes, or None when one holds a character JSON escapes (then a
    line's bytes would not show it verbatim)."""
    if not reserved or any(c in '"\\' or ord(c) < 0x20 for t in reserved for c in t):
        return None
    return re.compile(b"|".join(re.escape(t.encode()) for t in sorted(reserved, key=len, reverse=True)))


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dict keys included; iterative, so no nesting depth overflows the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _cut(text: str, turns: list[_Turn], needs_response: bool, turn: int | None, eot: str) -> Segmented:
    """Split `text` at every turn boundary; the last turn's start ends the prompt."""
    for t in turns:
        n = text.count(eot, t.start, t.end)
        if t.supervised and not (n == 1 and text.endswith(eot, t.start, t.end)):
            code = "extra_end_of_turn" if n > 1 else "no_end_of_turn"
            raise Reject(
                "render",
                code,
                f"the supervised span of messages[{t.index}] holds {n} end-of-turn tokens {eot}, not exactly one at "
                "its end",
            )
    bounds = sorted({0, len(text), *(t.start for t in turns), *(t.end for t in turns if t.supervised)})
    spans = sorted((t.start, t.end) for t in turns if t.supervised)
    starts = [s for s, _ in spans]
    reach = list(accumulate((e for _, e in spans), max))  # the furthest end of the spans starting up to each one
    pieces = []
    for a, b in pairwise(bounds):
        if a < b:  # supervised when a span starting at or before `a` reaches `b`: linear in the turns, not quadratic
            i = bisect_right(starts, a)
            pieces.append((text[a:b], i > 0 and reach[i - 1] >= b))
    prompt_end = turns[-1].start
    prompt_pieces = sum(1 for a, b in pairwise(bounds) if a < b and b <= prompt_end)
    return Segmented(pieces, prompt_pieces, needs_response, turn)
