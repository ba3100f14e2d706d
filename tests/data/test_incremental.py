"""One render per conversation (raypipe/data/incremental.py): what the proof accepts and refuses, marks that change
nothing else, and rows equal to those of rendering every turn's prefix on its own, on random conversations of many
turns in any role order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypipe.assets.templates import load_template
from raypipe.data import incremental
from raypipe.data.formats import Conversation, Reject
from raypipe.data.render import ChatRenderer
from raypipe.data.template_engine import PROBES, JinjaEngine
from tests.data.test_masks_property import SETTINGS, TEXT, TOOLS
from tests.helpers import renderer

RESERVED = ["<|im_start|>", "<|im_end|>"]

# Incremental templates unlike chatml: a system prompt read through messages[0] and skipped with `continue`, a refusal
# decided by the turn before (loop.previtem), a generation prompt that depends on enable_thinking, and the loop's tag
# closed with `-%}` and with plain `%}` before a newline kept by trim_blocks.
SYSTEM_FIRST = """{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}
{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- for message in messages -%}
    {%- if loop.first and message.role == 'system' %}{%- continue %}{%- endif %}
    {%- if loop.previtem is defined and loop.previtem.role == message.role == 'user' %}
        {{- raise_exception('two user turns in a row') }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + (message.content | trim) + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
NUMBERED = """{% for message in messages %}
<|im_start|>{{ message.role }}
{{ loop.index }}. {{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
INCREMENTAL = {"chatml": load_template("chatml"), "system_first": SYSTEM_FIRST, "numbered": NUMBERED}

CHATML_LOOP = "{%- for message in messages %}"


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (load_template("qwen_strict"), "exactly one top-level loop"),
        (load_template("generation_markers"), "{% generation %}"),
        (
            load_template("chatml").replace("'<|im_end|>\\n'", "'<|im_end|>' + ('' if loop.last else '\\n')"),
            "loop.last",
        ),
        (load_template("chatml").replace(CHATML_LOOP, CHATML_LOOP + "{{ loop.length }}"), "loop.last"),
        (load_template("chatml").replace(CHATML_LOOP, CHATML_LOOP + "{{ loop }}"), "all of loop"),
        (load_template("chatml").replace(CHATML_LOOP, CHATML_LOOP + "{{ messages | length }}"), "messages[0]"),
        (load_template("chatml").replace(CHATML_LOOP, CHATML_LOOP + "{{ messages[-1].role }}"), "messages[0]"),
        (load_template("chatml").replace(CHATML_LOOP, CHATML_LOOP + "{% break %}"), "can break"),
        (load_template("chatml").replace(CHATML_LOOP, "{%- for message in messages if message.content %}"), "filter"),
        ("{% set messages = messages[1:] %}" + load_template("chatml"), "assigns messages"),
        ("{% macro m(x) %}{{ x }}{% endmacro %}" + load_template("chatml"), "macro"),
        ("{% if add_generation_prompt %}x{% endif %}" + load_template("chatml"), "add_generation_prompt is read"),
        (load_template("chatml") + "{{ '\\n' }}", "follows the loop"),
        (
            "{% set ns = namespace(n=0) %}"
            + load_template("chatml").replace(
                "{%- if add_generation_prompt %}", "{%- if add_generation_prompt %}{{ ns.n }}"
            ),
            "reads ns",
        ),
        (load_template("chatml") + "{% if add_generation_prompt %}{{ tools }}{% endif %}", "reads tools"),
    ],
    ids=lambda value: value if len(value) < 40 else "",
)
def test_the_proof_refuses_what_could_read_later_messages(template, reason):
    refused = incremental.prove(template)
    assert refused is not None and reason in refused
    prompt, note = incremental.verify(template, {"enable_thinking": False}, "jinja")
    assert prompt is None and reason in note


@pytest.mark.parametrize("name", INCREMENTAL)
@pytest.mark.parametrize("thinking", [False, True])
def test_the_proof_accepts_and_the_probes_confirm(name, thinking):
    template = INCREMENTAL[name]
    assert incremental.prove(template) is None
    for engine in ("jinja", "minijinja"):
        prompt, note = incremental.verify(template, {"enable_thinking": thinking}, engine)
        assert prompt is not None and prompt.startswith("<|im_start|>assistant\n"), note


@pytest.mark.parametrize("name", INCREMENTAL)
def test_marks_change_nothing_else_in_the_text(name):
    template = INCREMENTAL[name]
    plain = JinjaEngine(template, {})
    marked = JinjaEngine(incremental.mark_turns(template), {incremental.MARK_VAR: incremental.MARK})
    rendered = 0
    for messages, tools in PROBES:
        try:
            want = plain.render(messages, tools, False)
        except Reject:
            continue
        text = marked.render(messages, tools, False)
        assert text.count(incremental.MARK) == len(messages)
        assert text.replace(incremental.MARK, "") == want
        rendered += 1
    assert rendered >= len(PROBES) // 2


def pair(name: str, thinking: bool) -> tuple[ChatRenderer, ChatRenderer]:
    """(one render per conversation, every turn's prefix rendered on its own), same engine."""
    template, kwargs = INCREMENTAL[name], {"enable_thinking": thinking}
    fast = ChatRenderer(template, kwargs, "<|im_end|>", "OK.", RESERVED)
    slow = ChatRenderer(template, kwargs, "<|im_end|>", "OK.", RESERVED, engine=fast.engine.name)
    assert fast.marked is not None and slow.marked is None
    return fast, slow


PAIRS = {(name, thinking): pair(name, thinking) for name in INCREMENTAL for thinking in (False, True)}
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "assistant", "tool"]),
        "content": TEXT | st.just("a\x00b"),
    },
    optional={"reasoning_content": TEXT},
)


def outcome(chat: ChatRenderer, conv: Conversation):
    try:
        return chat.segment(conv)
    except Reject as err:
        return err.code, err.reason


@SETTINGS
@given(
    st.lists(MESSAGE, min_size=1, max_size=24),
    st.booleans(),
    st.sets(st.integers(0, 23)),
    st.sampled_from(sorted(PAIRS)),
)
def test_one_render_gives_the_rows_of_every_prefix_rendered(messages, with_tools, context_only, key):
    fast, slow = PAIRS[key]
    conv = Conversation(messages, TOOLS if with_tools else None, None, frozenset(context_only))
    assert outcome(fast, conv) == outcome(slow, conv)


def test_a_mark_in_the_data_falls_back_to_every_prefix():
    fast, slow = PAIRS["chatml", False]
    messages = [{"role": "user", "content": "hi \x00 there"}, {"role": "assistant", "content": "ok"}]
    assert fast._segment_incremental(messages, None, False, frozenset()) is None
    conv = Conversation(messages, None, None)
    assert fast.segment(conv) == slow.segment(conv)


def test_the_built_in_templates_verdicts_reach_the_actors():
    assert renderer("chatml").marked is not None
    assert renderer("qwen_strict").marked is None
    assert renderer("generation_markers").marked is None


def test_a_long_conversation_is_rendered_once():
    """The rows of 200 turns come from one render, not 400: the engine is called once."""
    fast, _ = PAIRS["chatml", True]
    messages = [{"role": r, "content": f"{r} {i}"} for i in range(200) for r in ("user", "assistant")]
    calls = []
    engine = fast.marked
    original = engine.render
    engine.render = lambda *a: calls.append(a) or original(*a)
    plain = fast.engine.render
    fast.engine.render = lambda *a: calls.append(a) or plain(*a)
    try:
        [row] = fast.segment(Conversation(messages, None, None))
    finally:
        engine.render, fast.engine.render = original, plain
    assert len(calls) == 1
    assert sum(supervised for _, supervised in row.pieces) == 200
