"""Rendering long conversations: one render (a template proved incremental) against every turn's prefix rendered.

    python bench/long_conversations.py

1. One conversation of N tool-using exchanges (a user query, an assistant reply with a tool call, the tool's result,
an answer), rendered into rows by the stage's renderer for the built-in templates with the Qwen vocabulary:
- `chatml` (proved incremental): one render of the marked template, against the same renderer made to render each
  turn's prompt and the conversation through it (2 renders per assistant turn), side by side, same engine, same
  rows (asserted);
- `qwen_strict` (rewrites earlier turns, so not provable: one row per turn; shown for scale).
For each, the raw tokenizer's batch call on the rows it makes, one thread: what tokenizing them costs anyway.
2. The project's multi-turn mix (bench.corpus, 8,000 rows: chats, tool use and agentic traces of up to 5
exchanges), every row rendered both ways with `chatml` (same rows and rejects, asserted), against the raw tokenizer
on the rows.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ["RAYON_NUM_THREADS"] = "1"

from tokenizers import Tokenizer  # noqa: E402

from bench.corpus import CorpusSpec, write_corpus  # noqa: E402
from raypipe.config import load_config  # noqa: E402
from raypipe.data.formats import Conversation, Reject, normalize  # noqa: E402
from raypipe.data.render import ChatRenderer  # noqa: E402
from raypipe.data.tokenizer import resolve_tokenizer  # noqa: E402

OUT = Path(__file__).parent / "out"

WORDS = "the model reads a file and calls tools to answer what the user asks about code data tests".split()
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(exchanges: int) -> Conversation:
    rng = random.Random(exchanges)
    messages: list[dict] = [{"role": "system", "content": words(rng, 40)}]
    for i in range(exchanges):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": {"path": f"f{i}"}}}
        messages += [
            {"role": "user", "content": words(rng, 60)},
            {"role": "assistant", "content": words(rng, 150), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": words(rng, 200)},
            {"role": "assistant", "content": words(rng, 50)},
        ]
    return Conversation(messages, TOOLS, None)


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def counted(chat: ChatRenderer) -> Callable[[], int]:
    """Counts the calls to the renderer's engines from now on; returns a reader of the count."""
    calls = [0]
    for engine in (chat.engine, chat.marked):
        if engine is not None:
            render = engine.render
            engine.render = lambda *a, _render=render: calls.__setitem__(0, calls[0] + 1) or _render(*a)
    return lambda: calls[0]


def measure(template: str, exchanges: int, paths: list[tuple[str, ChatRenderer, Callable[[], int]]],
            backend: Tokenizer) -> dict[str, float]:  # fmt: skip
    """Prints a row of the table per path; returns each path's render time in ms."""
    conv = conversation(exchanges)
    want, render_ms = None, {}
    for name, chat, count in paths:
        before = count()
        seconds, rows = best_of(3, lambda: chat.segment(conv))  # noqa: B023 - called before the loop moves on
        renders = (count() - before) // 3
        want = rows if want is None else want
        assert rows == want, "the two paths made different rows"
        texts = ["".join(text for text, _ in row.pieces) for row in rows]
        tokenize, _ = best_of(3, lambda: backend.encode_batch_fast(texts, add_special_tokens=False))  # noqa: B023
        print(
            f"| {template} | {exchanges} | {2 * exchanges} | {len(rows)} | {name} | {renders} | "
            f"{seconds * 1000:.1f} ms | {tokenize * 1000:.1f} ms |"
        )
        render_ms[name] = seconds * 1000
    return render_ms


def segment_all(chat: ChatRenderer, convs: list[Conversation]) -> list:
    out = []
    for conv in convs:
        try:
            out.append(chat.segment(conv))
        except Reject as err:
            out.append(err.code)
    return out


def multi_turn_mix(samples: int) -> float:
    """Prints the mix's render times both ways; returns every prefix's over one render's."""
    corpus = OUT / f"corpus-multi_turn-{samples}"
    write_corpus(corpus, CorpusSpec(num_samples=samples, mix="multi_turn"))
    convs = []
    for path in sorted(corpus.glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                convs.append(normalize(json.loads(line)))
            except Reject:
                continue
    _, spec = resolve_tokenizer(load_config("debug_cpu", ["data.chat_template=chatml"]).data)
    one, every = ChatRenderer.of(spec, "OK."), ChatRenderer.of(spec, "OK.")
    every.marked = None
    t_one, rows = best_of(3, lambda: segment_all(one, convs))
    t_every, rows_every = best_of(3, lambda: segment_all(every, convs))
    assert rows == rows_every, "the two paths made different rows"
    texts = ["".join(t for t, _ in seg.pieces) for segs in rows if isinstance(segs, list) for seg in segs]
    backend = Tokenizer.from_str(spec.tokenizer_json)
    t_raw, _ = best_of(3, lambda: backend.encode_batch_fast(texts, add_special_tokens=False))
    print(f"\nmulti-turn mix, {len(convs):,} conversations, {len(texts):,} rows, chatml, best of 3:")
    print(f"- one render: {t_one:.2f} s; every prefix: {t_every:.2f} s ({t_every / t_one:.2f}x)")
    print(f"- the raw tokenizer on the rows: {t_raw:.2f} s (rendering one way: {t_one / t_raw:.0%} of it; the other: "
          f"{t_every / t_raw:.0%})")  # fmt: skip
    return t_every / t_one


def main() -> None:
    print("| template | exchanges | assistant turns | rows | path | renders | render time | raw tokenizer on rows |")
    print("|---|---|---|---|---|---|---|---|")
    for template in ("chatml", "qwen_strict"):
        _, spec = resolve_tokenizer(load_config("debug_cpu", [f"data.chat_template={template}"]).data)
        backend = Tokenizer.from_str(spec.tokenizer_json)
        one, every = ChatRenderer.of(spec, "OK."), ChatRenderer.of(spec, "OK.")
        every.marked = None  # every turn's prefix rendered on its own
        paths = [("every prefix" if one.marked else "per turn", every, counted(every))]
        if one.marked is not None:
            paths.insert(0, ("one render", one, counted(one)))
        for exchanges in (5, 25, 100, 250) if one.marked else (5, 25, 100):  # qwen_strict's rows grow as N^2
            render_ms = measure(template, exchanges, paths, backend)
        if template == "chatml":
            longest = [figure(f"chatml, {exchanges} exchanges: {path}", ms, "ms") for path, ms in render_ms.items()]
    record(
        "long_conversations",
        [*longest, figure("multi-turn mix: every prefix over one render", multi_turn_mix(8_000), "x")],
    )


if __name__ == "__main__":
    main()
