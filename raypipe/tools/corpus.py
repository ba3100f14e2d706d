"""Synthetic reference corpus: the 913,786-sample chat mix the data stage is sized for (`raypipe corpus`).

Benchmarks and end-to-end tests need input shaped like the real mix (800K prompt-only
requests plus multi-turn chats, tool calls, long agentic coding traces and Alpaca rows)
in every input format, at full scale, with no download. Each shard is a pure function of
(spec, format, shard index): shards can be written independently, and re-runs are
byte-identical. Text is clean ASCII (bad inputs are tested elsewhere) built from
precomputed banks of English-like sentences, code and logs, so generation is fast.
"""

from __future__ import annotations

import json
import keyword
import math
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from raypipe.data.formats import FORMATS

REFERENCE_SAMPLES = 913_786

CATEGORIES = ("prompt_only", "multi_turn", "tool_calling", "agentic_coding", "alpaca")

# Full-scale counts of everything but prompt-only; prompt-only takes the rest (800,000).
_BASE_COUNTS = {"multi_turn": 32_000, "tool_calling": 22_000, "agentic_coding": 1_286, "alpaca": 58_500}
# The mixes: the reference corpus, and its conversations alone (multi-turn chats, tool use and agentic coding traces,
# with system prompts, reasoning and replies of hundreds of tokens, in their reference proportions): the harder load.
MIXES = ("reference", "multi_turn")
# How each category is split over the formats, in integer parts (exact, no float rounding).
_FORMAT_PARTS = {
    "prompt_only": {"openai": 5, "sharegpt": 3, "alpaca": 2},
    "multi_turn": {"openai": 3, "sharegpt": 2},
    "tool_calling": {"openai": 4, "sharegpt": 1},
    "agentic_coding": {"openai": 1},
    "alpaca": {"alpaca": 1},
}
_CHARS_PER_TOKEN = 4  # English-like text with Qwen's BPE; lengths below are in tokens.
_MANIFEST = "corpus.json"


@dataclass(frozen=True)
class CorpusSpec:
    """What to generate; the corpus is a pure function of this."""

    num_samples: int = REFERENCE_SAMPLES
    seed: int = 0
    rows_per_file: int = 50_000
    mix: str = "reference"  # one of MIXES

    def __post_init__(self) -> None:
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"CorpusSpec.num_samples must be an int >= 1, got {self.num_samples!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"CorpusSpec.seed must be an int, got {self.seed!r}")
        if not isinstance(self.rows_per_file, int) or self.rows_per_file < 1:
            raise ValueError(f"CorpusSpec.rows_per_file must be an int >= 1, got {self.rows_per_file!r}")
        if self.mix not in MIXES:
            raise ValueError(f"CorpusSpec.mix must be one of {', '.join(MIXES)}, got {self.mix!r}")


@dataclass(frozen=True)
class Shard:
    """One output file: its format, index and how many rows of each category it holds."""

    fmt: str
    index: int
    counts: dict[str, int]

    @property
    def relpath(self) -> str:
        return f"{self.fmt}/part-{self.index:05d}.jsonl"


# ---------------------------------------------------------------------------------------
# Planning: exact integer counts, so totals always add up at any scale.


def category_counts(num_samples: int, mix: str = "reference") -> dict[str, int]:
    """Scales the mix to num_samples; the rounding remainder goes to prompt-only (reference) or multi-turn chats."""
    if mix == "multi_turn":
        base = {c: _BASE_COUNTS[c] for c in ("tool_calling", "agentic_coding")}
        total = _BASE_COUNTS["multi_turn"] + sum(base.values())
        scaled = {c: n * num_samples // total for c, n in base.items()}
        return {"multi_turn": num_samples - sum(scaled.values()), **scaled}
    scaled = {c: n * num_samples // REFERENCE_SAMPLES for c, n in _BASE_COUNTS.items()}
    return {"prompt_only": num_samples - sum(scaled.values()), **scaled}


def format_counts(num_samples: int, mix: str = "reference") -> dict[str, dict[str, int]]:
    """Rows per format and category; the last format of a category takes its remainder."""
    out: dict[str, dict[str, int]] = {f: {} for f in FORMATS}
    for category, n in category_counts(num_samples, mix).items():
        parts = _FORMAT_PARTS[category]
        total_parts, left = sum(parts.values()), n
        for i, (fmt, part) in enumerate(parts.items()):
            take = left if i == len(parts) - 1 else n * part // total_parts
            out[fmt][category], left = take, left - take
    return out


def plan_shards(spec: CorpusSpec) -> list[Shard]:
    """Spreads each format's categories evenly over its files (largest remainder per file).

    Apportioning what is left over what is left keeps every file's counts exact and
    non-negative, and makes every file a mix rather than blocks of one category.
    """
    shards = []
    for fmt, counts in format_counts(spec.num_samples, spec.mix).items():
        remaining = {c: n for c, n in counts.items() if n}
        rows_left, index = sum(remaining.values()), 0
        while rows_left:
            size = min(spec.rows_per_file, rows_left)
            take = {c: size * n // rows_left for c, n in remaining.items()}
            by_fraction = sorted(remaining, key=lambda c: -(size * remaining[c] % rows_left))
            for c in by_fraction[: size - sum(take.values())]:
                take[c] += 1
            shards.append(Shard(fmt, index, {c: n for c, n in take.items() if n}))
            remaining = {c: n - take[c] for c, n in remaining.items()}
            rows_left, index = rows_left - size, index + 1
    return shards


# ---------------------------------------------------------------------------------------
# Text banks, built once from a fixed seed; rows then pick from them (fast, and text
# tokenizes like English prose, Python/JS code and logs).

_FUNCTION_WORDS = (
    "the of and to a in is it that for on with as was be at by this are from or have an they which "
    "one you we can will not all there their has but more if when so what about out up into than "
    "them then some these would other its only also how each may over most after should could between "
    "because through where while both any our very just before many such no those every same still "
    "even without under again well here much first two three few own often always never during within"
).split()
_NOUNS = (
    "time people year way day system data file code function value user number result problem example "
    "question answer list table model server request response error test change process project team "
    "company market price customer product service report plan idea story book city country world water "
    "energy food school student teacher course lesson history science language word sentence page image "
    "color design account message email meeting week month hour minute record field type class method "
    "object string array loop variable database query cache queue event signal memory disk network thread "
    "task job step stage pipeline batch sample feature label score weight layer rate cost budget risk goal "
    "policy rule health doctor patient garden river mountain weather music game film car road house room "
    "door window family friend child paper letter bank money tax office phone screen button form order "
    "payment invoice ticket issue branch commit release version config setting option path folder log"
).split()
_VERBS = (
    "make use find give tell work call try need feel become leave keep start show hear play run move live "
    "believe bring write provide include continue learn change lead understand follow create build read "
    "open return check load save update parse compute send receive handle process store fetch filter sort "
    "merge split convert validate measure improve reduce increase explain describe compare choose plan "
    "test fix debug deploy install configure train predict render format delete insert select count track "
    "schedule review share publish support manage organize"
).split()
_ADJECTIVES = (
    "good new long great little old right big high different small large next early young important "
    "public bad same able simple clear easy hard fast slow free full short low recent common local global "
    "main final current valid open safe strong quick quiet bright warm cold useful careful complete basic "
    "typical specific general modern single special stable random private secure daily weekly remote "
    "active empty"
).split()
_WORDS = _FUNCTION_WORDS + _NOUNS + _VERBS + _ADJECTIVES
# Identifiers in generated code must not be Python keywords or JavaScript reserved words.
_RESERVED = set(keyword.kwlist) | set(
    "class delete new default function public private static this try catch return".split()
)
_CODE_NOUNS = [w for w in _NOUNS if w not in _RESERVED]
_CODE_VERBS = [w for w in _VERBS if w not in _RESERVED]
_CODE_ADJECTIVES = [w for w in _ADJECTIVES if w not in _RESERVED]
_CITIES = (
    "Paris Tokyo Berlin Lisbon Toronto Sydney Chicago Madrid Oslo Cairo Denver Boston Seattle Dublin "
    "Vienna Prague Nairobi Lima Austin Portland Helsinki Warsaw Athens Mumbai Seoul Manila Lagos Zurich"
).split()
_NAMES = "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maya Noah Olivia Paul".split()
_PY_IMPORTS = (
    "import os",
    "import re",
    "import json",
    "import time",
    "import argparse",
    "import asyncio",
    "import hashlib",
    "from pathlib import Path",
    "from typing import Any, Iterable",
    "from dataclasses import dataclass, field",
    "from collections import defaultdict",
    "import numpy as np",
    "import pandas as pd",
    "from datetime import datetime, timedelta",
)
_JS_IMPORTS = (
    'import fs from "fs";',
    'import path from "path";',
    'import express from "express";',
    'import { useState, useEffect } from "react";',
    'const axios = require("axios");',
    'import { z } from "zod";',
    'const crypto = require("crypto");',
    'import lodash from "lodash";',
)


def _words_weights() -> list[float]:
    """Zipf-like cumulative weights: function words first, so they dominate as in English."""
    total, cum = 0.0, []
    for rank in range(len(_WORDS)):
        total += 1.0 / (rank + 8) ** 0.9
        cum.append(total)
    return cum


class _Banks:
    """Precomputed sentences, code, log lines and request openers (built once, ~1 s)."""

    def __init__(self) -> None:
        rng = random.Random("raypipe-corpus-banks-v1")
        self.cum = _words_weights()
        self.sentences = [self._sentence(rng) for _ in range(40_000)]
        self.short_sentences = [s for s in self.sentences if len(s) < 60]
        self.avg_sentence = sum(map(len, self.sentences)) / len(self.sentences) + 1
        self.snake = sorted({f"{v}_{n}" for v in _CODE_VERBS for n in _CODE_NOUNS})
        self.vars = _CODE_NOUNS + [f"{a}_{n}" for a in _CODE_ADJECTIVES[:40] for n in _CODE_NOUNS[:60]]
        self.code = {
            "python": [self._py_function(rng) for _ in range(3_000)] + [self._py_class(rng) for _ in range(600)],
            "javascript": [self._js_function(rng) for _ in range(2_000)],
        }
        self.small_code = {lang: [c for c in bank if len(c) < 400] for lang, bank in self.code.items()}
        self.tests = [self._py_test(rng) for _ in range(1_500)]
        self.headers = {
            "python": [
                self._header(rng, _PY_IMPORTS, "import logging", "\n\nlogger = logging.getLogger(__name__)")
                for _ in range(200)
            ],
            "javascript": [self._header(rng, _JS_IMPORTS, "", "") for _ in range(200)],
        }
        self.code_lines = [ln for block in self.code["python"][:800] for ln in block.splitlines() if ln.strip()]
        self.log_lines = [self._log_line(rng) for _ in range(6_000)]
        self.paths = sorted({f"src/{p}/{n}.py" for p in ("app", "core", "api", "utils") for n in self.snake[::97]})
        self.test_paths = [f"tests/test_{n}.py" for n in self.snake[::53]]
        self.requests = {kind: [self._fill(rng, t) for t in tpls for _ in range(60)] for kind, tpls in _OPENERS.items()}
        self.follow_ups = [self._fill(rng, t) for t in _FOLLOW_UPS for _ in range(40)]
        self.systems = [self._system(rng) for _ in range(400)]
        self.tasks = [self._fill(rng, t) for t in _AGENT_TASKS for _ in range(60)]

    def _sentence(self, rng: random.Random) -> str:
        words = rng.choices(_WORDS, cum_weights=self.cum, k=max(3, int(rng.lognormvariate(2.5, 0.4))))
        for i in range(1, len(words)):
            r = rng.random()
            if r < 0.03:
                words[i] = str(rng.choice((rng.randint(2, 99), rng.randint(100, 5000), rng.randint(1990, 2025))))
            elif r < 0.04:
                words[i] = f"`{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}()`"
            elif r < 0.07 and i < len(words) - 2:
                words[i] += ","
        words[0] = words[0].capitalize()
        return " ".join(words) + rng.choices(".?!", (88, 10, 2))[0]

    def _short(self, rng: random.Random) -> str:
        return rng.choice(self.short_sentences)

    def _fill(self, rng: random.Random, template: str) -> str:
        return template.format(
            noun=rng.choice(_NOUNS),
            noun2=rng.choice(_NOUNS),
            adj=rng.choice(_ADJECTIVES),
            verb=rng.choice(_VERBS),
            n=rng.randint(2, 12),
            lang=rng.choice(("Python", "JavaScript")),
            city=rng.choice(_CITIES),
            name=rng.choice(_NAMES),
            func=rng.choice(self.snake),
            words=rng.choice((100, 150, 200, 300, 500, 800)),
        )

    def _system(self, rng: random.Random) -> str:
        head = self._fill(rng, rng.choice(_SYSTEMS))
        extra = rng.choices(self.sentences, k=rng.choice((0, 0, 0, 1, 1, 2, 3, 6)))
        return " ".join([head, *extra])

    def _header(self, rng: random.Random, imports: tuple[str, ...], needed: str, tail: str) -> str:
        """Import lines for a module; `needed` is what the tail uses (the logger needs logging)."""
        return "\n".join(sorted({needed, *rng.sample(imports, rng.randint(2, 6))} - {""})) + tail

    def _names(self, rng: random.Random, k: int) -> list[str]:
        return rng.sample(self.vars, k)

    def _py_block(self, rng: random.Random, lines: list[str], names: list[str], depth: int, n: int) -> None:
        pad = "    " * (depth + 1)
        for _ in range(n):
            a, b = rng.choice(names), rng.choice(names)
            if rng.random() < 0.1:
                lines.append(f"{pad}# {self._short(rng)}")
            if rng.random() < 0.25 and depth < 2:
                header = rng.choice(
                    (
                        f"if {a} is None:",
                        f"if {a} > {rng.randint(1, 100)}:",
                        f"if not {a}:",
                        f"for item in {a}:",
                        f"while {a} < {rng.randint(2, 64)}:",
                        f"with open({a}) as handle:",
                    )
                )
                lines.append(pad + header)
                self._py_block(rng, lines, names, depth + 1, rng.randint(1, 3))
                continue
            new, noun = rng.choice(self.vars), rng.choice(_CODE_NOUNS)
            lines.append(
                pad
                + rng.choice(
                    (
                        f"{new} = {a}.{rng.choice(_CODE_VERBS)}({b})",
                        f"{new} = [item.{noun} for item in {a} if item.{rng.choice(_CODE_ADJECTIVES)}]",
                        f'{new} = {{"{noun}": {a}, "{rng.choice(_CODE_NOUNS)}": {rng.randint(0, 999)}}}',
                        f"{a}.{rng.choice(self.snake)}({b}, {noun}={rng.randint(0, 64)})",
                        f'logger.{rng.choice(("info", "debug", "warning"))}("{self._short(rng)[:-1]} %s", {a})',
                        f"{new} = {a} * {rng.randint(2, 16)} + len({b})",
                        f'{new} = f"{{{a}}}/{noun}-{{{b}}}"',
                    )
                )
            )
            names.append(new)

    def _py_function(self, rng: random.Random, prefix: str = "def ", first: tuple[str, ...] = ()) -> str:
        args = self._names(rng, rng.randint(1, 3))
        lines = [f"{prefix}{rng.choice(self.snake)}({', '.join((*first, *args))}):"]
        if rng.random() < 0.6:
            lines.append(f'    """{self._short(rng)}"""')
        names = list(args)
        self._py_block(rng, lines, names, 0, rng.randint(1, 8))
        lines.append(f"    return {rng.choice(names)}")
        return "\n".join(lines)

    def _py_class(self, rng: random.Random) -> str:
        name = "".join(w.capitalize() for w in rng.sample(_CODE_NOUNS, 2))
        fields = self._names(rng, rng.randint(1, 4))
        init = [f"    def __init__(self, {', '.join(fields)}):"] + [f"        self.{f} = {f}" for f in fields]
        methods = [
            "\n".join("    " + ln for ln in self._py_function(rng, first=("self",)).splitlines())
            for _ in range(rng.randint(1, 4))
        ]
        return "\n\n".join([f'class {name}:\n    """{self._short(rng)}"""', "\n".join(init), *methods])

    def _js_function(self, rng: random.Random) -> str:
        verb, noun = rng.choice(_CODE_VERBS), rng.choice(_CODE_NOUNS)
        name, args = verb + noun.capitalize(), [a.replace("_", "") for a in self._names(rng, rng.randint(1, 3))]
        head = rng.choice(
            (f"async function {name}({', '.join(args)}) {{", f"export const {name} = async ({', '.join(args)}) => {{")
        )
        lines, declared = [head], set(args)
        for _ in range(rng.randint(2, 9)):
            a, b = rng.choice(args), rng.choice(args)
            if rng.random() < 0.1:
                lines.append(f"  // {self._short(rng)}")
            kind = rng.random()
            if kind < 0.2:
                lines += [f"  if (!{a}) {{", f'    throw new Error("{self._short(rng)[:-1]}");', "  }"]
            elif kind < 0.35:
                lines += [
                    f"  for (const item of {a}) {{",
                    f"    {b}.{rng.choice(_CODE_VERBS)}(item.{rng.choice(_CODE_NOUNS)});",
                    "  }",
                ]
            elif kind < 0.5:
                lines.append(
                    rng.choice(
                        (f'  console.log("{self._short(rng)[:-1]}", {a});', f"  {a}.{rng.choice(_CODE_NOUNS)} = {b};")
                    )
                )
            else:
                noun = rng.choice(_CODE_NOUNS)
                new = noun + rng.choice(_CODE_NOUNS).capitalize()
                if new in declared:
                    continue
                lines.append(
                    "  "
                    + rng.choice(
                        (
                            f"const {new} = {a}.{rng.choice(('map', 'filter', 'find'))}((item) => item.{noun});",
                            f"let {new} = {rng.randint(0, 500)};",
                            f"const {new} = await fetch(`/api/{noun}/${{{a}}}`);",
                        )
                    )
                )
                declared.add(new)
                args.append(new)
        lines += [f"  return {rng.choice(args)};", "}" if head.startswith("async") else "};"]
        return "\n".join(lines)

    def _py_test(self, rng: random.Random) -> str:
        func, arg = rng.choice(self.snake), rng.choice(self.vars)
        return "\n".join(
            (
                f"def test_{func}_{rng.choice(_CODE_ADJECTIVES)}():",
                f"    {arg} = {rng.choice(self.snake)}({rng.randint(0, 99)})",
                f"    result = {func}({arg})",
                f"    assert result == {rng.randint(0, 99)}",
            )
        )

    def _log_line(self, rng: random.Random) -> str:
        day = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d},{rng.randint(0, 999):03d}"
        level = rng.choices(("INFO", "DEBUG", "WARNING", "ERROR"), (60, 25, 10, 5))[0]
        source = f"{rng.choice(('worker', 'api', 'scheduler', 'db'))}.{rng.choice(_NOUNS)}"
        return f"{day} {clock} {level} {source}: {self._short(rng)}"


_OPENERS = {
    "question": (
        "What is the best way to {verb} the {adj} {noun}?",
        "How do I {verb} the {noun} in {lang}?",
        "Why does my {noun} {verb} so slowly?",
        "What is the difference between a {noun} and a {noun2}?",
        "Can you explain how the {adj} {noun} works?",
        "Is it a good idea to {verb} every {noun}?",
    ),
    "instruction": (
        "Summarize the following text in {n} sentences.",
        "Rewrite the paragraph below so it sounds more formal.",
        "Explain the idea of the {adj} {noun} to a new student.",
        "List the pros and cons of this {noun} plan.",
        "Give me {n} ideas for the {adj} {noun} project.",
        "Write an email to {name} about the {noun} meeting.",
        "Extract the key points from this {noun} report.",
        "Turn these notes into a clear {noun} plan.",
        "Classify the following text by topic and tone.",
        "Answer the question using the text below.",
    ),
    "code": (
        "Write a {lang} function that can {verb} a list of {noun} objects.",
        "Implement a {lang} class for the {adj} {noun} cache with a size limit.",
        "Refactor this code so it is easier to test.",
        "Find the bug in the following code.",
        "Write unit tests for this function.",
        "Explain what this code does, line by line.",
        "Add type hints and docstrings to the code below.",
        "Make this function {verb} the {noun} in parallel.",
        "Convert this script into a command line tool with argparse.",
        "Why does `{func}` return None here?",
    ),
    "writing": (
        "Write a {words}-word essay about the {adj} {noun}.",
        "Write a short story about a {noun} in {city}.",
        "Write a poem about the {noun} and the {noun2}.",
        "Draft a blog post on how to {verb} a {noun}.",
        "Write a product description for the {adj} {noun}.",
        "Write a speech for {name} about {adj} {noun} policy.",
    ),
    "paste": (
        "Here is the log from our {noun} job. Why does it fail?",
        "This is my whole {lang} module. Can you review it?",
        "Our {noun} service prints this output. What is going wrong?",
        "Please review this file and suggest changes.",
    ),
}
_FOLLOW_UPS = (
    "Can you make it shorter?",
    "Thanks. Now {verb} the {noun} as well.",
    "What about the {adj} {noun}?",
    "Could you give an example in {lang}?",
    "Why is that better than using a {noun2}?",
    "Please explain the second point in more detail.",
    "Now add error handling for the {noun}.",
    "How would this change for {n} users?",
    "Great, can you write tests for it?",
)
_SYSTEMS = (
    "You are a helpful assistant.",
    "You are a senior {lang} engineer. Answer with working code.",
    "You are {name}, a friendly tutor who explains {noun} topics step by step.",
    "You are an expert on {adj} {noun} design. Be concise.",
    "You are a customer support agent for a {noun} company in {city}.",
    "Answer in a formal tone and cite the {noun} when you can.",
)
_AGENT_TASKS = (
    "The test `test_{func}` fails after the last commit. Find the cause and fix it.",
    "Add a `--{noun}` option to the command line tool and cover it with tests.",
    "Refactor `{func}` so it no longer reads the {noun} file twice.",
    "The {noun} service crashes when the {noun2} list is empty. Please fix it.",
    "Make `{func}` handle {adj} {noun} values and update the docs.",
)
_THINK_OPENERS = (
    "Okay, the user wants",
    "Let me think about this.",
    "First, I need to check",
    "Hmm, so the question is",
    "The key point here is",
    "Let me look at the code again.",
)


@cache
def _banks() -> _Banks:
    return _Banks()


# ---------------------------------------------------------------------------------------
# Tools: schemas plus argument and result generators.

_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]] = {
    "get_weather": (
        "Get the current weather for a city.",
        {"city": ("string", "City name, e.g. Paris."), "unit": ("string", "celsius or fahrenheit")},
        ("city",),
    ),
    "search_web": (
        "Search the web and return the top results.",
        {"query": ("string", "Search query."), "limit": ("integer", "How many results.")},
        ("query",),
    ),
    "get_stock_price": ("Get the latest price of a stock.", {"symbol": ("string", "Ticker symbol.")}, ("symbol",)),
    "convert_currency": (
        "Convert an amount between currencies.",
        {
            "amount": ("number", "Amount."),
            "from_currency": ("string", "Source currency."),
            "to_currency": ("string", "Target currency."),
        },
        ("amount", "from_currency", "to_currency"),
    ),
    "send_email": (
        "Send an email.",
        {
            "to": ("string", "Recipient address."),
            "subject": ("string", "Subject line."),
            "body": ("string", "Message body."),
        },
        ("to", "subject", "body"),
    ),
    "create_event": (
        "Create a calendar event.",
        {
            "title": ("string", "Event title."),
            "date": ("string", "Date, YYYY-MM-DD."),
            "duration_minutes": ("integer", "Length."),
        },
        ("title", "date"),
    ),
    "lookup_order": ("Look up an order by id.", {"order_id": ("string", "Order id.")}, ("order_id",)),
    "search_products": (
        "Search the product catalog.",
        {"query": ("string", "Search text."), "max_price": ("number", "Price limit.")},
        ("query",),
    ),
    "query_database": ("Run a read-only SQL query.", {"sql": ("string", "SQL SELECT statement.")}, ("sql",)),
    "get_directions": (
        "Get directions between two places.",
        {
            "origin": ("string", "Start."),
            "destination": ("string", "End."),
            "mode": ("string", "driving, walking or transit"),
        },
        ("origin", "destination"),
    ),
}
_AGENT_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]] = {
    "list_files": ("List files under a directory.", {"path": ("string", "Directory.")}, ("path",)),
    "read_file": ("Read a file from the repository.", {"path": ("string", "File path.")}, ("path",)),
    "search_code": (
        "Search the repository with a regular expression.",
        {"pattern": ("string", "Regex."), "path": ("string", "Where to search.")},
        ("pattern",),
    ),
    "edit_file": (
        "Replace old_str with new_str in a file.",
        {
            "path": ("string", "File path."),
            "old_str": ("string", "Exact text to replace."),
            "new_str": ("string", "Replacement."),
        },
        ("path", "old_str", "new_str"),
    ),
    "run_tests": ("Run the test suite or a subset of it.", {"target": ("string", "Test path or node id.")}, ()),
    "run_command": ("Run a shell command in the repository.", {"command": ("string", "Command line.")}, ("command",)),
}


def _schema(name: str, spec: tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]) -> dict[str, Any]:
    description, params, required = spec
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                "required": list(required),
            },
        },
    }


_TOOL_SCHEMAS = {name: _schema(name, spec) for name, spec in _TOOLS.items()}
_AGENT_SCHEMAS = [_schema(name, spec) for name, spec in _AGENT_TOOLS.items()]


# ---------------------------------------------------------------------------------------
# Row generation. One _Gen per shard, driven by the shard's own Random.


class _Gen:
    """Builds rows of every (format, category) from one shard's Random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.b = rng, _banks()

    # Text pieces.

    def tokens(self, median: float, sigma: float, cap: int) -> int:
        """A log-normal length in characters: most texts short, a long tail up to cap tokens."""
        return int(min(self.rng.lognormvariate(math.log(median), sigma), cap) * _CHARS_PER_TOKEN)

    def prose(self, chars: int) -> str:
        k = max(1, round(chars / self.b.avg_sentence))
        sentences = self.rng.choices(self.b.sentences, k=k)
        if k <= 4:
            return " ".join(sentences)
        step = self.rng.randint(3, 6)
        return "\n\n".join(" ".join(sentences[i : i + step]) for i in range(0, k, step))

    def code(self, lang: str, chars: int, header: bool = True) -> str:
        parts = [self.rng.choice(self.b.headers[lang])] if header else []
        size = 0
        while size < chars or not parts:
            part = self.rng.choice(self.b.code[lang])
            parts.append(part)
            size += len(part) + 3
        return "\n\n\n".join(parts) if lang == "python" else "\n\n".join(parts)

    def fenced(self, lang: str, chars: int) -> str:
        """A code block; short ones come from the bank of short functions, as pasted in questions."""
        code = self.rng.choice(self.b.small_code[lang]) if chars < 400 else self.code(lang, chars, header=False)
        return f"```{lang}\n{code}\n```"

    def log(self, chars: int) -> str:
        return "\n".join(self.rng.choices(self.b.log_lines, k=max(1, chars // 90)))

    def language(self) -> str:
        return self.rng.choices(("python", "javascript"), (75, 25))[0]

    def request(self) -> tuple[str, str | None]:
        """A user request as (instruction, material or None): the prompt-only workhorse."""
        rng = self.rng
        kind = rng.choices(("question", "instruction", "code", "writing", "paste"), (20, 40, 27, 12.4, 0.6))[0]
        opener = rng.choice(self.b.requests[kind])
        if kind == "question":
            return (opener if rng.random() < 0.6 else f"{self.prose(self.tokens(25, 0.7, 400))} {opener}"), None
        if kind == "instruction":
            return opener, self.prose(self.tokens(16, 0.9, 2_000))
        if kind == "writing":
            return opener + (f" {self.prose(self.tokens(15, 0.6, 200))}" if rng.random() < 0.5 else ""), None
        if kind == "code":
            if rng.random() < 0.3:
                return opener, self.fenced(self.language(), self.tokens(45, 0.8, 2_500))
            return f"{opener} {self.prose(self.tokens(15, 0.8, 600))}", None
        material = (
            self.log(self.tokens(600, 0.8, 8_000))
            if rng.random() < 0.5
            else self.code(self.language(), self.tokens(600, 0.8, 8_000))
        )
        return opener, f"```\n{material}\n```"

    def user_text(self) -> str:
        instruction, material = self.request()
        if material is None:
            return instruction
        return f"{instruction}\n\n{material}" if self.rng.random() < 0.8 else f"{material}\n\n{instruction}"

    def reply(self, median: float) -> str:
        rng, text = self.rng, self.prose(self.tokens(median, 0.8, 3_000))
        r = rng.random()
        if r < 0.2:
            block = self.fenced(self.language(), self.tokens(60, 0.7, 2_000))
            return f"{text}\n\n{block}\n\n{rng.choice(self.b.sentences)}"
        if r < 0.35:
            items = "\n".join(f"{i}. {s}" for i, s in enumerate(rng.choices(self.b.sentences, k=rng.randint(3, 7)), 1))
            return f"{rng.choice(self.b.sentences)}\n\n{items}"
        return text

    def thinking(self, median: float) -> str:
        return f"{self.rng.choice(_THINK_OPENERS)} {self.prose(self.tokens(median, 0.7, 2_000))}"

    def system(self) -> str:
        return self.rng.choice(self.b.systems)

    def call_id(self) -> str:
        return f"call_{self.rng.getrandbits(96):024x}"

    # Tool arguments and results.

    def argument(self, name: str, kind: str) -> Any:
        rng = self.rng
        if kind == "integer":
            return rng.randint(1, 50)
        if kind == "number":
            return round(rng.uniform(1, 5_000), 2)
        special: dict[str, Callable[[], Any]] = {
            "city": lambda: rng.choice(_CITIES),
            "origin": lambda: rng.choice(_CITIES),
            "destination": lambda: rng.choice(_CITIES),
            "unit": lambda: rng.choice(("celsius", "fahrenheit")),
            "mode": lambda: rng.choice(("driving", "walking", "transit")),
            "symbol": lambda: rng.choice(("AAPL", "MSFT", "NVDA", "GOOG", "AMZN", "TSLA")),
            "from_currency": lambda: rng.choice(("USD", "EUR", "JPY", "GBP")),
            "to_currency": lambda: rng.choice(("USD", "EUR", "JPY", "GBP")),
            "to": lambda: f"{rng.choice(_NAMES).lower()}@example.com",
            "date": lambda: f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "order_id": lambda: f"ORD-{rng.randint(10_000, 99_999)}",
            "sql": lambda: (
                f"SELECT {rng.choice(_NOUNS)}, COUNT(*) FROM {rng.choice(_NOUNS)}s"
                f" WHERE {rng.choice(_NOUNS)} > {rng.randint(1, 99)} GROUP BY 1"
            ),
            "body": lambda: self.prose(self.tokens(60, 0.6, 600)),
        }
        return special[name]() if name in special else rng.choice(self.b.short_sentences)[:-1]

    def tool_result(self, name: str) -> str:
        rng = self.rng
        if name in ("search_web", "search_products"):
            items = [
                {
                    "title": rng.choice(self.b.short_sentences)[:-1],
                    "url": f"https://example.com/{rng.choice(_NOUNS)}/{rng.randint(1, 9_999)}",
                    "snippet": rng.choice(self.b.sentences),
                }
                for _ in range(rng.randint(2, 6))
            ]
            return json.dumps({"results": items})
        if name == "query_database":
            rows = [[rng.choice(_NOUNS), rng.randint(1, 9_999)] for _ in range(rng.randint(2, 25))]
            return json.dumps({"columns": ["name", "count"], "rows": rows})
        if name == "get_weather":
            return json.dumps(
                {
                    "temperature": round(rng.uniform(-10, 35), 1),
                    "conditions": rng.choice(("sunny", "cloudy", "rain", "snow")),
                    "humidity": rng.randint(10, 95),
                }
            )
        return json.dumps({"status": "ok", "id": rng.randint(1_000, 99_999), "detail": rng.choice(self.b.sentences)})

    def tool_calls(self, tools: list[str], as_string: bool) -> list[dict[str, Any]]:
        calls = []
        for name in self.rng.choices(tools, k=self.rng.choices((1, 2, 3), (70, 22, 8))[0]):
            params, required = _TOOLS[name][1], _TOOLS[name][2]
            args = {k: self.argument(k, t) for k, (t, _) in params.items() if k in required or self.rng.random() < 0.4}
            calls.append(
                {
                    "id": self.call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args) if as_string else args},
                }
            )
        return calls

    # Rows by (format, category).

    def openai_prompt(self) -> dict[str, Any]:
        messages = [{"role": "system", "content": self.system()}] if self.rng.random() < 0.1 else []
        messages.append({"role": "user", "content": self.user_text()})
        return {"messages": messages}

    def sharegpt_prompt(self) -> dict[str, Any]:
        turns = [{"from": "system", "value": self.system()}] if self.rng.random() < 0.08 else []
        turns.append({"from": "human", "value": self.user_text()})
        return {"conversations": turns}

    def alpaca_prompt(self) -> dict[str, Any]:
        instruction, material = self.request()
        return {"instruction": instruction, "input": material} if material is not None else {"instruction": instruction}

    def alpaca_full(self) -> dict[str, Any]:
        row = self.alpaca_prompt()
        code = "```" in row.get("input", "") or self.rng.random() < 0.2
        row["output"] = (
            self.fenced(self.language(), self.tokens(35, 0.8, 2_000))
            if code
            else self.prose(self.tokens(30, 0.8, 2_000))
        )
        return row

    def chat(self) -> list[tuple[str, str]]:
        """(role, text) turns of a multi-turn chat with 2-8 user/assistant exchanges."""
        rng = self.rng
        turns = [("system", self.system())] if rng.random() < 0.3 else []
        for i in range(rng.choices(range(2, 9), (40, 25, 14, 9, 6, 4, 2))[0]):
            user = (
                self.user_text()
                if i == 0
                else rng.choice(self.b.follow_ups)
                + (f" {self.prose(self.tokens(20, 0.8, 300))}" if rng.random() < 0.4 else "")
            )
            turns += [("user", user), ("assistant", self.reply(32))]
        return turns

    def openai_chat(self) -> dict[str, Any]:
        think = self.rng.random() < 0.3
        messages = []
        for role, text in self.chat():
            message = {"role": role, "content": text}
            if think and role == "assistant":
                message["reasoning_content"] = self.thinking(40)
            messages.append(message)
        return {"messages": messages}

    def sharegpt_chat(self) -> dict[str, Any]:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[role], "value": text} for role, text in self.chat()]}

    def tool_episode(self, as_string: bool) -> tuple[list[dict[str, Any]], list[str]]:
        """OpenAI messages of a tool-calling chat, and the tools offered."""
        rng = self.rng
        used = rng.sample(list(_TOOLS), rng.choice((1, 1, 2)))
        offered = sorted(set(used) | set(rng.sample(list(_TOOLS), rng.randint(0, 2))))
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system()}] if rng.random() < 0.5 else []
        messages.append(
            {"role": "user", "content": f"{rng.choice(self.b.sentences)} {self.prose(self.tokens(20, 0.7, 400))}"}
        )
        for _ in range(rng.choices((1, 2), (75, 25))[0]):
            calls = self.tool_calls(used, as_string)
            content = "" if rng.random() < 0.6 else rng.choice(self.b.short_sentences)
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": self.tool_result(c["function"]["name"])}
                for c in calls
            ]
        if rng.random() < 0.85:
            messages.append({"role": "assistant", "content": self.reply(40)})
        return messages, offered

    def openai_tools(self) -> dict[str, Any]:
        messages, offered = self.tool_episode(as_string=self.rng.random() < 0.8)
        return {"messages": messages, "tools": [_TOOL_SCHEMAS[name] for name in offered]}

    def sharegpt_tools(self) -> dict[str, Any]:
        """ShareGPT tool use as seen in the wild: schemas in the system turn, calls as <tool_call> text."""
        messages, offered = self.tool_episode(as_string=False)
        schemas = json.dumps([_TOOL_SCHEMAS[name]["function"] for name in offered], indent=2)
        turns = [{"from": "system", "value": f"You are a helpful assistant with access to these functions:\n{schemas}"}]
        for m in messages:
            if m["role"] == "assistant" and "tool_calls" in m:
                calls = "\n".join(
                    f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
                    for name, args in (c["function"].values() for c in m["tool_calls"])
                )
                turns.append({"from": "gpt", "value": f"{m['content']}\n{calls}" if m["content"] else calls})
            elif m["role"] != "system":
                turns.append(
                    {"from": {"user": "human", "assistant": "gpt", "tool": "tool"}[m["role"]], "value": m["content"]}
                )
        return {"conversations": turns}

    def test_log(self, chars: int, failing: bool) -> str:
        rng, b = self.rng, self.b
        tests = [f"{rng.choice(b.test_paths)}::test_{rng.choice(b.snake)}" for _ in range(max(3, chars // 95))]
        lines = [
            "=" * 29 + " test session starts " + "=" * 30,
            "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0",
            "rootdir: /workspace/project",
            f"collected {len(tests)} items",
            "",
        ]
        lines += [
            f"{t} {'FAILED' if failing and i == 1 else 'PASSED'} [{100 * (i + 1) // len(tests):3d}%]"
            for i, t in enumerate(tests)
        ]
        if failing:
            lines += [
                "",
                "=" * 35 + " FAILURES " + "=" * 35,
                f"_____ {tests[1].split('::')[1]} _____",
                "",
                *("    " + ln for ln in rng.choice(b.tests).splitlines()),
                f"E       AssertionError: assert {rng.randint(0, 99)} == {rng.randint(0, 99)}",
                "",
                f"{tests[1].split('::')[0]}:{rng.randint(5, 400)}: AssertionError",
                f"FAILED {tests[1]} - AssertionError",
            ]
        summary = f"{int(failing)} failed, {len(tests) - int(failing)} passed" if failing else f"{len(tests)} passed"
        return "\n".join([*lines, f"{'=' * 20} {summary} in {rng.uniform(0.5, 60):.2f}s {'=' * 20}"])

    def snippet(self) -> str:
        start = self.rng.randrange(len(self.b.code_lines) - 12)
        return "\n".join(self.b.code_lines[start : start + self.rng.randint(2, 10)])

    def diff(self, path: str) -> str:
        old, new = self.snippet().splitlines(), self.snippet().splitlines()
        line = self.rng.randint(1, 400)
        body = [f" {ln}" for ln in old[:1]] + [f"-{ln}" for ln in old[1:]] + [f"+{ln}" for ln in new]
        return f"--- a/{path}\n+++ b/{path}\n@@ -{line},{len(old)} +{line},{len(new) + 1} @@\n" + "\n".join(body)

    def agent_step(self, name: str, path: str) -> tuple[dict[str, Any], str]:
        """One tool call of a coding agent and its result (file contents and logs are long)."""
        rng, b = self.rng, self.b
        if name == "read_file":
            args, result = {"path": path}, self.code("python", self.tokens(700, 0.6, 9_000))
        elif name == "list_files":
            args, result = (
                {"path": "."},
                "\n".join(sorted(set(rng.choices(b.paths + b.test_paths, k=rng.randint(10, 80))))),
            )
        elif name == "search_code":
            args = {"pattern": rng.choice(b.snake), "path": "src"}
            result = "\n".join(
                f"{rng.choice(b.paths)}:{rng.randint(1, 900)}:{rng.choice(b.code_lines).strip()}"
                for _ in range(rng.randint(3, 40))
            )
        elif name == "edit_file":
            args = {"path": path, "old_str": self.snippet(), "new_str": self.snippet()}
            result = f"The file {path} has been edited. Here is the result of the edit:\n{self.snippet()}"
        elif name == "run_command":
            args, result = (
                {"command": rng.choice(("python -m build", "make lint", "git status", "python scripts/check.py"))},
                self.log(self.tokens(300, 0.8, 4_000)),
            )
        else:
            failing = rng.random() < 0.5
            args, result = (
                {"target": rng.choice(b.test_paths)},
                self.test_log(self.tokens(500 if failing else 250, 0.7, 6_000), failing),
            )
        return {
            "id": self.call_id(),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }, result

    def openai_agentic(self) -> dict[str, Any]:
        rng, b = self.rng, self.b
        think = rng.random() < 0.4
        path = rng.choice(b.paths)
        system = f"You are a coding agent working in a Python repository. {self.prose(self.tokens(350, 0.5, 1_500))}"
        task = rng.choice(b.tasks)
        user = (
            f"{task}\n\n```\n{self.test_log(self.tokens(300, 0.6, 3_000), True)}\n```" if rng.random() < 0.4 else task
        )
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        plan = (
            ["list_files"] * (rng.random() < 0.5)
            + ["search_code"] * (rng.random() < 0.6)
            + ["read_file"] * rng.randint(1, 3)
        )
        plan += ["run_tests", "edit_file"] * rng.randint(1, 2) + ["run_command"] * (rng.random() < 0.3) + ["run_tests"]
        for name in plan:
            call, result = self.agent_step(name, path if rng.random() < 0.7 else rng.choice(b.paths + b.test_paths))
            message = {
                "role": "assistant",
                "content": "" if rng.random() < 0.5 else rng.choice(b.sentences),
                "tool_calls": [call],
            }
            if think:
                message["reasoning_content"] = self.thinking(40)
            messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": result}]
        messages.append(
            {
                "role": "assistant",
                "content": f"{self.prose(self.tokens(80, 0.6, 800))}\n\n```diff\n{self.diff(path)}\n```",
            }
        )
        return {"messages": messages, "tools": _AGENT_SCHEMAS}


_BUILDERS: dict[tuple[str, str], Callable[[_Gen], dict[str, Any]]] = {
    ("openai", "prompt_only"): _Gen.openai_prompt,
    ("openai", "multi_turn"): _Gen.openai_chat,
    ("openai", "tool_calling"): _Gen.openai_tools,
    ("openai", "agentic_coding"): _Gen.openai_agentic,
    ("sharegpt", "prompt_only"): _Gen.sharegpt_prompt,
    ("sharegpt", "multi_turn"): _Gen.sharegpt_chat,
    ("sharegpt", "tool_calling"): _Gen.sharegpt_tools,
    ("alpaca", "prompt_only"): _Gen.alpaca_prompt,
    ("alpaca", "alpaca"): _Gen.alpaca_full,
}


def _content_chars(row: dict[str, Any]) -> int:
    """Characters of text a chat template would render (contents, reasoning, call arguments)."""
    if "messages" in row:
        total = 0
        for m in row["messages"]:
            total += len(m["content"]) + len(m.get("reasoning_content", ""))
            for call in m.get("tool_calls", ()):
                args = call["function"]["arguments"]
                total += len(args) if isinstance(args, str) else len(json.dumps(args))
        return total
    if "conversations" in row:
        return sum(len(t["value"]) for t in row["conversations"])
    return len(row["instruction"]) + len(row.get("input", "")) + len(row.get("output", ""))


# ---------------------------------------------------------------------------------------
# Writing: atomic files, a manifest updated after each file, skip what is complete.


def write_shard(output_dir: str | Path, spec: CorpusSpec, shard: Shard) -> dict[str, Any]:
    """Writes one file (temp name, then rename) and returns its stats for the manifest.

    The Random is seeded from (seed, format, index) alone and the category counts come from
    the plan, so any file can be made on its own, in any process, with the same bytes.
    """
    rng = random.Random(f"raypipe-corpus/{spec.seed}/{shard.fmt}/{shard.index}")
    gen = _Gen(rng)
    order = [c for c in CATEGORIES for _ in range(shard.counts.get(c, 0))]
    rng.shuffle(order)
    stats = {c: {"rows": 0, "content_chars": 0} for c in CATEGORIES if c in shard.counts}
    path = Path(output_dir) / shard.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    prefix = f"ref{spec.seed}-{shard.fmt}-{shard.index:05d}-"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        for j, category in enumerate(order):
            row = _BUILDERS[shard.fmt, category](gen)
            if shard.fmt != "alpaca" or rng.random() < 0.5:
                row = {"id": f"{prefix}{j:06d}", **row}
            f.write(json.dumps(row))
            f.write("\n")
            stats[category]["rows"] += 1
            stats[category]["content_chars"] += _content_chars(row)
    os.replace(tmp, path)
    return {
        "rows": len(order),
        "bytes": path.stat().st_size,
        "content_chars": sum(s["content_chars"] for s in stats.values()),
        "categories": stats,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="ascii")
    os.replace(tmp, path)


def _summary(spec: CorpusSpec, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per category and per format and character totals, from per-file stats."""
    categories = {c: {"rows": 0, "content_chars": 0} for c in CATEGORIES}
    formats: dict[str, dict[str, Any]] = {
        f: {"rows": 0, "files": 0, "bytes": 0, "content_chars": 0, "categories": {}} for f in FORMATS
    }
    for relpath, stats in files.items():
        fmt = formats[relpath.split("/")[0]]
        fmt["files"] += 1
        for key in ("rows", "bytes", "content_chars"):
            fmt[key] += stats[key]
        for c, s in stats["categories"].items():
            fmt["categories"][c] = fmt["categories"].get(c, 0) + s["rows"]
            categories[c]["rows"] += s["rows"]
            categories[c]["content_chars"] += s["content_chars"]
    total = {k: sum(f[k] for f in formats.values()) for k in ("rows", "files", "bytes", "content_chars")}
    return {
        "spec": asdict(spec),
        "counts": {c: s["rows"] for c, s in categories.items()},
        "categories": categories,
        "formats": formats,
        "total": total,
    }


def write_corpus(output_dir: str | Path, spec: CorpusSpec = CorpusSpec()) -> dict[str, int]:
    """Writes <output_dir>/{openai,sharegpt,alpaca}/part-NNNNN.jsonl and <output_dir>/corpus.json.

    Prompt-only rows live in the format folders, mixed with the others of that format.
    Each file is written atomically and recorded in corpus.json at once, so a re-run with
    the same spec skips recorded files whose size matches and rewrites the rest (same bytes).
    Returns the row count per category.
    """
    out = Path(output_dir)
    manifest_path = out / _MANIFEST
    files: dict[str, dict[str, Any]] = {}
    if manifest_path.exists():
        previous = json.loads(manifest_path.read_text())
        if previous["spec"] != asdict(spec):
            raise ValueError(
                f"{out} holds a corpus of spec {previous['spec']}, not {asdict(spec)}; "
                "delete it or use an empty output_dir"
            )
        files = previous["files"]
    out.mkdir(parents=True, exist_ok=True)
    for shard in plan_shards(spec):
        path, recorded = out / shard.relpath, files.get(shard.relpath)
        if recorded is None or not path.exists() or path.stat().st_size != recorded["bytes"]:
            files[shard.relpath] = write_shard(out, spec, shard)
            _write_json(manifest_path, {"spec": asdict(spec), "complete": False, "files": files})
    summary = _summary(spec, files)
    planned = dict.fromkeys(CATEGORIES, 0) | category_counts(spec.num_samples, spec.mix)
    assert summary["counts"] == planned, "written rows differ from the plan"
    _write_json(manifest_path, {**summary, "complete": True, "files": files})
    counts: dict[str, int] = summary["counts"]
    return counts
