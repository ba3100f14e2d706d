"""One row of each category in each format, from a seeded generator over the banks."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

from bench.corpus.banks import _CITIES, _NAMES, _NOUNS, _THINK_OPENERS, _banks
from bench.corpus.plan import _CHARS_PER_TOKEN
from bench.corpus.tools import _AGENT_SCHEMAS, _TOOL_SCHEMAS, _TOOLS


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
