"""Property tests: over random conversations, masks equal independent oracles.

- generation-marker template: transformers' `return_assistant_tokens_mask`;
- strict Qwen-style template: the mask obtained by rendering each assistant
  turn's own prefix with `apply_chat_template` (add_generation_prompt=True)
  and the conversation through that turn.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from raypipe.data.formats import Reject, normalize
from raypipe.data.render import ChatRenderer
from tests.helpers import qwen_spec, renderer

ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), include_characters="\n\t ")
# Content spelling a special token is rejected by design (tests/data/test_render.py), so none is generated here.
TEXT = st.one_of(
    st.just(""),
    st.text(ALPHABET, max_size=40).filter(lambda t: "<|" not in t),
    st.sampled_from(
        [
            "Hello world",
            "def f(x):\n    return x",
            "  spaced  ",
            "\nleading newline",
            "日本語のテキスト",
            "emoji 🙂🚀",
            "x\n\n\ny",
        ]
    ),
)
NAMES = st.sampled_from(["get_weather", "run_tests", "read_file"])


@st.composite
def conversations(draw) -> list[dict]:
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        if draw(st.integers(0, 4)) == 0:
            break  # ends with a user turn: a placeholder reply is injected
        reply: dict = {"role": "assistant", "content": draw(TEXT)}
        if draw(st.integers(0, 3)) == 0:
            reply["reasoning_content"] = draw(TEXT)
        if draw(st.integers(0, 3)) == 0:
            calls = draw(
                st.lists(
                    st.tuples(
                        NAMES,
                        st.dictionaries(st.sampled_from(["a", "path", "n"]), st.integers(0, 9) | TEXT, max_size=2),
                    ),
                    min_size=1,
                    max_size=2,
                )
            )
            reply["tool_calls"] = [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ]
            messages.append(reply)
            for i in range(len(calls)):
                messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": draw(TEXT)})
            if draw(st.booleans()):
                messages.append({"role": "assistant", "content": draw(TEXT)})
        else:
            messages.append(reply)
    return messages


TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": "d", "parameters": {"type": "object", "properties": {}}},
    }
    for n in ["get_weather", "run_tests", "read_file"]
]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def _parts(template: str, thinking: bool) -> tuple[ChatRenderer, Tokenizer]:
    _, spec = qwen_spec(template, thinking)
    return renderer(template, thinking), Tokenizer.from_str(spec.tokenizer_json)


def rows_of(template: str, thinking: bool, record: dict) -> list[dict]:
    """Our rows for one record: the stage's renderer, each piece tokenized on its own as the stage does."""
    chat, backend = _parts(template, thinking)
    segs = chat.segment(normalize(record))
    out = []
    for seg in segs:
        ids, mask, prompt_len = [], [], 0
        for n, (text, sup) in enumerate(seg.pieces):
            piece = backend.encode(text, add_special_tokens=False).ids
            ids += piece
            mask += [int(sup)] * len(piece)
            prompt_len += len(piece) if n < seg.prompt_pieces else 0
        out.append({"ids": ids, "mask": mask, "prompt_len": prompt_len, "seg": seg})
    return out


def runs(mask: list[int]) -> list[tuple[int, int]]:
    m = np.asarray(mask, dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@SETTINGS
@given(conversations(), st.booleans())
def test_strict_template_mask_equals_per_turn_prefix_oracle(messages, thinking):
    tok, _ = qwen_spec("qwen_strict", thinking)
    record = {"messages": messages, "tools": TOOLS}
    needs_response = messages[-1]["role"] != "assistant"
    full_msgs = messages + ([{"role": "assistant", "content": "OK."}] if needs_response else [])

    def render(msgs, gen):
        return tok.apply_chat_template(
            msgs, tools=TOOLS, tokenize=False, add_generation_prompt=gen, enable_thinking=thinking
        )

    try:
        full = render(full_msgs, False)
    except Exception:
        full = None
    try:
        rows = rows_of("qwen_strict", thinking, record)
    except Reject as rej:
        assert full is None or rej.code in ("turn_does_not_extend_prompt", "no_supervised_turn"), rej
        return
    assert full is not None

    # The oracle: each assistant turn's own prompt and reply, from apply_chat_template alone.
    turns = []
    for k, m in enumerate(full_msgs):
        if m["role"] != "assistant":
            continue
        try:
            prefix = render(full_msgs[:k], True)
        except Exception:
            continue  # no prompt renders for it: context only
        through = render(full_msgs[: k + 1], False)
        assert through.startswith(prefix)
        end = through.index("<|im_end|>", len(prefix)) + len("<|im_end|>")
        turns.append((k, prefix, through[len(prefix) : end], through))
    supervised = turns[:-1] if needs_response else turns
    render_once = all(full.startswith(t[3][: len(t[1]) + len(t[2])]) for t in turns)

    if render_once:
        [row] = rows
        assert tok.decode(row["ids"]) == full
        got = runs(row["mask"])
        assert len(got) == len([t for t in supervised if t[2]])
        for (a, b), (_, prefix, reply, _) in zip(got, [t for t in supervised if t[2]]):
            assert tok.decode(row["ids"][:a]) == prefix  # supervision starts where the turn's own prompt ends
            assert row["ids"][a:b] == tok(reply, add_special_tokens=False)["input_ids"]  # exactly the emitted tokens
        assert tok.decode(row["ids"][: row["prompt_len"]]) == turns[-1][1]
    else:
        assert [r["seg"].turn for r in rows] == [t[0] for t in turns]
        for row, (k, prefix, reply, through) in zip(rows, turns):
            is_placeholder = needs_response and k == turns[-1][0]
            p = tok(prefix, add_special_tokens=False)["input_ids"]
            r = tok(reply, add_special_tokens=False)["input_ids"]
            tail = tok(through[len(prefix) + len(reply) :], add_special_tokens=False)["input_ids"]
            assert row["ids"] == p + r + tail
            assert row["mask"] == [0] * len(p) + [0 if is_placeholder else 1] * len(r) + [0] * len(tail)
            assert row["prompt_len"] == len(p)


@SETTINGS
@given(conversations())
def test_generation_marker_mask_equals_transformers(messages):
    if messages[-1]["role"] != "assistant":
        messages = messages + [{"role": "assistant", "content": "done"}]  # transformers would mask a placeholder too
    tok, _ = qwen_spec("generation_markers")
    out = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    [row] = rows_of("generation_markers", False, {"messages": messages, "tools": TOOLS})
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    # The ids decode to the text as Qwen's NFC normalizer rewrites it (U+F900 becomes U+8C48).
    assert tok.decode(row["ids"]) == tok.backend_tokenizer.normalizer.normalize_str(text)
    if row["ids"] == list(out["input_ids"]):
        assert row["mask"] == list(out["assistant_masks"])
    else:
        # Only where BPE merges the prompt's final newline into a reply starting with whitespace (a newline, or
        # spaces before the newline the template puts ahead of a tool call) do the tokenizations differ;
        # transformers then masks a token the engine never emits. Ours splits it.
        replies = [
            "<think>"
            if m.get("reasoning_content")
            else m["content"] or ("<tool_call>" if m.get("tool_calls") else "<|im_end|>")
            for m in messages
            if m["role"] == "assistant"
        ]
        assert any(r[:1].isspace() for r in replies), replies
        got = ["".join(tok.decode(row["ids"][a:b])) for a, b in runs(row["mask"])]
        assert all(g.endswith("<|im_end|>") for g in got) and len(got) == len(replies)


@SETTINGS
@given(conversations(), st.booleans(), st.sampled_from(["qwen_strict", "generation_markers", "chatml"]))
def test_faster_sandbox_renders_exactly_like_a_fresh_one(messages, gen_prompt, template):
    """The Jinja engine's sandbox shortcuts must not change a single character."""
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    from raypipe.data.template_engine import JinjaEngine

    _, spec = qwen_spec(template, False)
    jinja = JinjaEngine(spec.chat_template, spec.template_kwargs)
    fresh = _cached_compile_jinja_template(spec.chat_template)  # a new, untouched environment
    assert not getattr(fresh.environment, "_raypipe_fast", False)
    msgs = normalize({"messages": messages}).messages
    try:
        expected = fresh.render(
            messages=msgs, tools=TOOLS, documents=None, add_generation_prompt=gen_prompt, **spec.template_kwargs
        )
    except Exception as err:  # the template refuses: so must the engine
        with pytest.raises(Reject):
            jinja.render(msgs, TOOLS, gen_prompt)
        assert type(err).__name__ in ("TemplateError", "TemplateRuntimeError")
        return
    assert jinja.render(msgs, TOOLS, gen_prompt) == expected
