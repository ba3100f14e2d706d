"""Templates proved to render every prefix of a conversation as a prefix of the whole: one render per conversation.

Cutting a conversation into supervised turns needs, for each assistant turn k,
what the engine sees as its prompt (messages[:k] with the generation prompt)
and the conversation through it (messages[:k+1]). Rendering both for every
turn is 2N renders of growing length: quadratic in the turns. Most templates
write a header from `messages[0]` and the tools, then one block per message
that depends only on that message and the ones before it, then the generation
prompt; for them those texts are slices of the one whole render. `prove` shows
that from the template's syntax tree, conservatively (anything it does not
understand is not proved, and rendering stays per turn):
- `messages` is iterated by exactly one loop, at the top level, with no filter,
  else or recursion, and is otherwise read only as `messages[0]`; nothing
  assigns `messages` or `loop`;
- in that loop, `loop` is read only for what is known when an iteration starts
  (`index`, `index0`, `first`, `previtem`, `cycle`, `changed`, `depth`), never
  `last`, `length`, `revindex` or `nextitem`, and there is no `break`;
- after it come only `{% if add_generation_prompt %}` blocks that read no name
  the template assigns, nor `messages` or `tools`: the generation prompt is the
  same text after every prefix, and nothing follows the last turn without it;
- no macros, call blocks, includes, imports or inheritance, whose bodies the
  rules above would not see.
Then the template with a mark written at the start of each iteration
(`mark_turns`) renders a conversation once: messages[:j] renders as the text
before mark j, and with the generation prompt as that text plus the prompt.
On the driver, `verify` also checks this on every prefix of every probe
against the template's own renders.
"""

from __future__ import annotations

import re
from typing import Any

import jinja2
from jinja2 import nodes

from raypipe.data.formats import Reject
from raypipe.data.template_engine import GENERATION_TAG, PROBES, build_engine

MARK = "\x00"  # written at the start of every message's block; a mark in the data shows as one mark too many
MARK_VAR = "raypipe_turn_mark"
_KNOWN_AT_START = frozenset({"index", "index0", "first", "previtem", "cycle", "changed", "depth", "depth0"})
_OPAQUE = (nodes.Macro, nodes.CallBlock, nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block)
_MAIN_LOOP_TAG = re.compile(r"\{%([-+]?)\s*for\s+\w+\s+in\s+messages\s*([-+]?)%\}")


def prove(template: str) -> str | None:
    """None when the rules of this module hold for the template; else the first one it breaks."""
    if GENERATION_TAG.search(template):
        return "the template has {% generation %} blocks, which already mark every turn"
    if MARK_VAR in template:
        return f"the template uses the name {MARK_VAR}"
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError as err:
        return f"jinja2 cannot parse it ({err})"
    for node in tree.find_all(_OPAQUE):
        return f"it has a {type(node).__name__.lower()}, whose body this proof does not follow"
    loops = [node for node in tree.find_all(nodes.For) if _is_name(node.iter, "messages")]
    at = [i for i, node in enumerate(tree.body) if loops and node is loops[0]]
    if len(loops) != 1 or not at:
        return "messages is not iterated by exactly one top-level loop"
    main = loops[0]
    if main.test is not None or main.else_ or main.recursive or not isinstance(main.target, nodes.Name):
        return "the loop over messages has a filter, an else, recursion or several targets"
    for name in tree.find_all(nodes.Name):
        if name.ctx != "load" and name.name in ("messages", "loop"):
            return f"the template assigns {name.name}"
    reason = _messages_only_first(tree, main)
    if reason is None:
        reason = _loop_reads_no_future(main.body)
    if reason is None:
        reason = _constant_generation_prompt(tree, tree.body[at[0] + 1 :])
    if reason is None and len(_MAIN_LOOP_TAG.findall(template)) != 1:
        reason = "the loop over messages cannot be told apart in the source"
    return reason


def mark_turns(template: str) -> str:
    """The template with `MARK_VAR` written at the start of every iteration over messages, all else as rendered.

    The mark goes right after the loop's tag and is followed by an empty `if` closed as the loop's tag was, so the
    whitespace control that applied after the loop's tag (trim_blocks, `-%}`) applies after it unchanged.
    """
    tag = _MAIN_LOOP_TAG.search(template)
    assert tag is not None, "mark_turns needs a template `prove` accepted"
    closing = tag.group(2)
    return f"{template[: tag.end()]}{{{{ {MARK_VAR} }}}}{{% if false %}}{{% endif {closing}%}}{template[tag.end() :]}"


def cut_marks(marked: str, n_messages: int) -> tuple[str, list[int]] | None:
    """(the whole text, where each of the n messages' blocks starts, then its end); None if the text has a mark
    the loop did not write (a mark in the data)."""
    parts = marked.split(MARK)
    if len(parts) != n_messages + 1:
        return None
    offsets, at = [], 0
    for part in parts:
        at += len(part)
        offsets.append(at)
    return "".join(parts), offsets


def verify(template: str, kwargs: dict[str, Any], engine: str) -> tuple[str | None, str]:
    """(the generation prompt, or None when prefixes are rendered one by one; the reason), on the driver.

    The proof, then its claim on every prefix of every probe: the marked template's one render, cut at its
    marks, equals each prefix's own render by `engine`, with and without the generation prompt."""
    reason = prove(template)
    if reason is not None:
        return None, f"each turn's prefix rendered on its own: {reason}"
    plain = build_engine(template, kwargs, engine)
    marked = build_engine(mark_turns(template), {**kwargs, MARK_VAR: MARK}, engine)
    prompt = None
    for i, (messages, tools) in enumerate(PROBES):
        whole = _outcome(marked, messages, tools, False)
        cut = None if whole is None else cut_marks(whole, len(messages))
        if whole is None and _outcome(plain, messages, tools, False) is None:
            continue  # refused either way, as it must be
        if cut is None:
            return None, f"each turn's prefix rendered on its own: probe {i} is refused or marked out of place"
        text, offsets = cut
        for j in range(1, len(messages) + 1):
            without = _outcome(plain, messages[:j], tools, False)
            with_prompt = _outcome(plain, messages[:j], tools, True)
            if prompt is None and without is not None and with_prompt is not None:
                prompt = with_prompt[len(without) :]
            if without != text[: offsets[j]] or with_prompt != f"{without}{prompt}":
                return None, f"each turn's prefix rendered on its own: probe {i} renders messages[:{j}] otherwise"
    if prompt is None:
        return None, "each turn's prefix rendered on its own: the template refuses every probe"
    return prompt, "one render per conversation: every prefix renders as a prefix of the whole (proved and probed)"


def _outcome(engine: Any, messages: list[dict[str, Any]], tools: Any, gen_prompt: bool) -> str | None:
    try:
        return engine.render(messages, tools, gen_prompt)
    except Reject:
        return None


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def _messages_only_first(tree: nodes.Template, main: nodes.For) -> str | None:
    allowed = {id(main.iter)}
    for item in tree.find_all(nodes.Getitem):
        if _is_name(item.node, "messages") and isinstance(item.arg, nodes.Const) and item.arg.value == 0:
            allowed.add(id(item.node))
    for name in tree.find_all(nodes.Name):
        if name.name == "messages" and id(name) not in allowed:
            return "messages is read other than as the loop's items or messages[0]"
    return None


def _loop_reads_no_future(body: list[nodes.Node]) -> str | None:
    """`loop` of the main loop read only for what is known at an iteration's start; nested loops have their own."""
    allowed: set[int] = set()
    stack: list[nodes.Node] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, nodes.Break):
            return "the loop over messages can break"
        if isinstance(node, nodes.For):  # its body sees its own `loop`; its items, filter and else are checked as ours
            stack.extend([node.iter, *node.else_] + ([node.test] if node.test is not None else []))
            continue
        if isinstance(node, nodes.Getattr) and _is_name(node.node, "loop") and node.attr in _KNOWN_AT_START:
            allowed.add(id(node.node))
        if _is_name(node, "loop") and id(node) not in allowed:
            return "the loop over messages reads loop.last, loop.length, loop.revindex or loop.nextitem, or all of loop"
        stack.extend(node.iter_child_nodes())
    return None


def _constant_generation_prompt(tree: nodes.Template, after: list[nodes.Node]) -> str | None:
    """Only `{% if add_generation_prompt %}` blocks after the loop, reading nothing a prefix changes; and
    `add_generation_prompt` read nowhere else, so the rest renders the same with and without it."""
    assigned = {n.name for n in tree.find_all(nodes.Name) if n.ctx != "load"}
    tests = set()
    for node in after:
        if (
            not (isinstance(node, nodes.If) and _is_name(node.test, "add_generation_prompt"))
            or node.elif_
            or node.else_
        ):
            return "something other than {% if add_generation_prompt %} follows the loop over messages"
        tests.add(id(node.test))
        for name in node.find_all(nodes.Name):
            if name.name in assigned or name.name in ("messages", "tools", "loop"):
                return f"the generation prompt reads {name.name}"
    for name in tree.find_all(nodes.Name):
        if name.name == "add_generation_prompt" and id(name) not in tests:
            return "add_generation_prompt is read before the end of the loop over messages or inside its block"
    return None
