"""The data stage's fast path (MiniJinja where it was shown equal, one render per conversation where the template was
proved incremental, one tokenizer encoding per row) writes exactly the rows of the reference path (transformers' Jinja,
every turn's prefix rendered on its own, each piece tokenized on its own), on random conversations, for every built-in
template with thinking on and off."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raypipe.data.formats import Reject, normalize
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import plan_chunks
from raypipe.data.template_engine import JinjaEngine, MiniJinjaEngine
from tests.data.test_masks_property import SETTINGS, TOOLS, conversations
from tests.helpers import data_config, qwen_spec, renderer

TEMPLATES = [(t, thinking) for t in ("qwen_strict", "chatml", "generation_markers") for thinking in (False, True)]


@cache
def preparer(template: str, thinking: bool) -> ShardPreparer:
    cfg = data_config(chat_template=template, enable_thinking=thinking, output="unused")
    return ShardPreparer(cfg, qwen_spec(template, thinking)[1])


@cache
def reference(template: str, thinking: bool):
    """The reference path's renderer and tokenizer: Jinja always, every turn's prefix rendered, pieces one by one."""
    chat = renderer(template, thinking)
    if isinstance(chat.engine, MiniJinjaEngine):
        chat.engine = chat.engine.fallback
    chat.marked = None
    return chat, preparer(template, thinking).backend


def reference_rows(template: str, thinking: bool, record: dict) -> list[tuple[list[int], list[int], int]]:
    chat, backend = reference(template, thinking)
    try:
        segs = chat.segment(normalize(record))
    except Reject:
        return []
    rows = []
    for seg in segs:
        ids, mask, prompt_len = [], [], 0
        for n, (text, supervised) in enumerate(seg.pieces):
            piece = backend.encode(text, add_special_tokens=False).ids
            ids, mask = ids + piece, mask + [int(supervised)] * len(piece)
            prompt_len += len(piece) if n < seg.prompt_pieces else 0
        rows.append((ids, mask, prompt_len))
    return rows


@pytest.mark.parametrize(("template", "thinking"), TEMPLATES)
def test_minijinja_renders_the_templates_it_was_shown_equal_on(template, thinking):
    engine = preparer(template, thinking).renderer.engine
    expected = JinjaEngine if template == "generation_markers" else MiniJinjaEngine
    assert type(engine) is expected


@SETTINGS
@given(st.lists(conversations(), min_size=1, max_size=6), st.sampled_from(TEMPLATES))
def test_fast_rows_equal_the_reference_rows(tmp_path_factory, batch, template_thinking):
    template, thinking = template_thinking
    records = [{"messages": m, "tools": TOOLS if i % 2 else None} for i, m in enumerate(batch)]
    path = tmp_path_factory.mktemp("fast") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    [chunk] = plan_chunks(data_config(sources=[{"path": str(path)}], output="unused").sources, {}, 1 << 30)
    table = preparer(template, thinking).prepare(chunk).table
    got = list(
        zip(
            table.column("input_ids").to_pylist(),
            table.column("loss_mask").to_pylist(),
            table.column("prompt_len").to_pylist(),
        )
    )
    expected = [row for r in records for row in reference_rows(template, thinking, r)]
    assert got == expected


@SETTINGS
@given(conversations(), st.booleans(), st.sampled_from(TEMPLATES[:4]))
def test_minijinja_renders_exactly_as_jinja(messages, gen_prompt, template_thinking):
    """MiniJinja's own text (no fallback), against Jinja's: equal, or both refuse."""
    engine = preparer(*template_thinking).renderer.engine
    assert isinstance(engine, MiniJinjaEngine)
    msgs = normalize({"messages": messages}).messages
    try:
        expected = engine.fallback.render(msgs, TOOLS, gen_prompt)
    except Reject:
        with pytest.raises(Exception):  # noqa: B017 - MiniJinja refuses too, in its own words
            engine.render_own(msgs, TOOLS, gen_prompt)
        return
    assert engine.render_own(msgs, TOOLS, gen_prompt) == expected


def test_an_actor_built_from_the_spec_neither_reprobes_nor_imports_transformers(tmp_path):
    """What an actor does (ShardPreparer from the driver's spec, one shard prepared) in a fresh process: MiniJinja
    as the driver chose it, and no transformers or torch loaded, which would cost each actor seconds at start-up."""
    _, spec = qwen_spec("qwen_strict", False)
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
    )
    code = f"""
import pickle, sys
from pathlib import Path
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import plan_chunks
from tests.helpers import data_config
cfg = data_config(sources=[{{"path": {str(path)!r}}}])
preparer = ShardPreparer(cfg, pickle.loads(Path({str(tmp_path / "spec.pkl")!r}).read_bytes()))
[chunk] = plan_chunks(cfg.sources, {{}}, 1 << 30)
print(preparer.prepare(chunk).table.num_rows, type(preparer.renderer.engine).__name__,
      sorted({{"transformers", "torch"}} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "MiniJinjaEngine", "[]"]
