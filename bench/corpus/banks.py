"""The text the synthetic corpus is built from: English-like sentences, code, log lines, openers (built once)."""

from __future__ import annotations

import keyword
import random
from functools import cache

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
