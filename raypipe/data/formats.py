"""Input formats -> one normalized conversation shape.

Every supported format (OpenAI messages, ShareGPT, Alpaca; each possibly
prompt-only) becomes `Conversation(messages, tools)` with messages in the
OpenAI shape templates expect. OpenAI's `developer` role (its current name
for the system message) is read as `system` in every format with roles:
chat templates know `system`, so the template sees the same conversation,
and its rules on where a system message may stand apply unchanged. Anything
that does not fit raises `Reject` with a stable code and a one-line reason,
so bad rows are explained rather than crashing the job or vanishing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("openai", "sharegpt", "alpaca")
# role in the data -> role the template sees
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {  # ShareGPT's own names, and OpenAI's role names as some ShareGPT data writes them in `from`
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}


class Reject(Exception):
    """A row that cannot be used: where it was refused, a stable code, and why."""

    def __init__(self, stage: str, code: str, reason: str) -> None:
        super().__init__(f"{stage}/{code}: {reason}")
        self.stage = stage
        self.code = code
        self.reason = reason


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    id: str | None
    context_only: frozenset[int] = field(
        default_factory=frozenset
    )  # assistant turns with weight 0: rendered, never supervised


def _bad(code: str, reason: str) -> Reject:
    return Reject("normalize", code, reason)


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    keys = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise _bad("unknown_format", f"no messages/conversations/instruction key (keys: {keys})")


def _text(value: Any, where: str, *, allow_none: bool = False) -> str:
    """Content is a string or a list of text parts; anything else is refused."""
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)
    raise _bad("bad_content", f"{where} content must be a string or a list of text parts, got {type(value).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise _bad("bad_tool_call", f"{where} tool_calls must be a non-empty list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("bad_tool_call", f"{where} tool_calls[{j}] needs function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise _bad(
                    "bad_tool_call", f"{where} tool_calls[{j}].function.arguments is not valid JSON ({err.msg})"
                ) from None
        if not isinstance(args, dict):
            raise _bad("bad_tool_call", f"{where} tool_calls[{j}].function.arguments must be a JSON object")
        item: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


def _turns(record: dict[str, Any], key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, turn) for a list of objects under `key`."""
    turns = record[key]
    if not isinstance(turns, list):
        raise _bad("bad_messages", f"{key} must be a list, got {type(turns).__name__}")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _bad("bad_messages", f"{key}[{i}] must be an object, got {type(turn).__name__}")
        yield f"{key}[{i}]", turn


def _weightless(where: str, msg: dict[str, Any]) -> bool:
    """OpenAI's per-turn `weight`: absent or 1 trains on the turn, 0 keeps it as context only."""
    if "weight" not in msg:
        return False
    weight = msg["weight"]
    if msg.get("role") != "assistant" or type(weight) not in (int, float) or weight not in (0, 1):
        raise _bad(
            "bad_weight",
            f"{where} weight must be 0 or 1 on an assistant turn, got {weight!r:.40} on {msg.get('role')!r:.40}",
        )
    return weight == 0


def _openai(record: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, frozenset[int]]:
    out, context_only = [], set()
    for i, (where, msg) in enumerate(_turns(record, "messages")):
        if _weightless(where, msg):
            context_only.add(i)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad("unknown_role", f"{where} role {role!r} is not one of {', '.join(ROLES)}")
        calls = msg.get("tool_calls")
        has_calls = role == "assistant" and calls is not None
        if "content" not in msg and not has_calls:
            raise _bad("missing_content", f"{where} ({role}) has no content")
        norm: dict[str, Any] = {"role": ROLES[role], "content": _text(msg.get("content"), where, allow_none=has_calls)}
        if has_calls:
            norm["tool_calls"] = _tool_calls(calls, where)
        elif calls is not None:
            raise _bad("bad_tool_call", f"{where} has tool_calls but role {role!r}; only assistant turns call tools")
        reasoning = msg.get("reasoning_content")
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise _bad("bad_reasoning", f"{where} reasoning_content must be a string on an assistant turn")
            norm["reasoning_content"] = reasoning
        if role == "tool" and msg.get("tool_call_id") is not None:
            if not isinstance(msg["tool_call_id"], str):
                raise _bad("bad_tool_call", f"{where} tool_call_id must be a string")
            norm["tool_call_id"] = msg["tool_call_id"]
        out.append(norm)
    return out, record.get("tools"), frozenset(context_only)


def _sharegpt(record: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for where, turn in _turns(record, "conversations"):
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise _bad("unknown_role", f"{where} from {speaker!r:.60} is not one of {', '.join(SHAREGPT_ROLES)}")
        if "value" not in turn:
            raise _bad("missing_content", f"{where} has no value")
        out.append({"role": role, "content": _text(turn["value"], where)})
    return out


def _alpaca(record: dict[str, Any]) -> list[dict[str, Any]]:
    instruction = record["instruction"]
    extra, output = record.get("input"), record.get("output")
    if not isinstance(instruction, str):
        raise _bad("bad_content", f"instruction must be a string, got {type(instruction).__name__}")
    for key, value in (("input", extra), ("output", output)):
        if value is not None and not isinstance(value, str):
            raise _bad("bad_content", f"{key} must be a string, got {type(value).__name__}")
    if not instruction.strip():
        raise _bad("empty_prompt", "instruction is empty")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "user", "content": prompt}]
    if output:  # "" means no reply, as in the wild: the row is prompt-only
        messages.append({"role": "assistant", "content": output})
    return messages


def normalize(record: Any, declared: str = "auto") -> Conversation:
    """Raw record -> Conversation in the OpenAI shape; raises Reject."""
    if not isinstance(record, dict):
        raise _bad("not_an_object", f"row must be a JSON object, got {type(record).__name__}")
    fmt = detect_format(record)
    if declared != "auto" and fmt != declared:
        raise _bad("format_mismatch", f"source is declared {declared} but the row looks like {fmt}")
    tools, context_only = None, frozenset[int]()
    if fmt == "openai":
        messages, tools, context_only = _openai(record)
    elif fmt == "sharegpt":
        messages = _sharegpt(record)
    else:
        messages = _alpaca(record)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _bad("bad_tools", "tools must be a list of JSON schema objects")
    if not messages:
        raise _bad("no_messages", "conversation has no messages")
    if not any(m["role"] in ("user", "assistant") for m in messages):
        raise _bad("no_dialogue", "conversation has no user or assistant message (system/tool only)")
    return Conversation(messages, tools or None, _id(record.get("id")), context_only)


def _id(raw_id: Any) -> str | None:
    """The row's own id (a string or an integer), which must be writable as UTF-8."""
    if isinstance(raw_id, int):
        return str(raw_id)
    if not isinstance(raw_id, str) or raw_id == "":
        return None
    try:
        raw_id.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _bad("bad_id", f"id holds {raw_id[err.start]!r}, a lone UTF-16 surrogate, which is not text") from None
    return raw_id
