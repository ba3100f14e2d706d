"""A corpus of bad rows, one kind per entry, interleaved with good rows."""

import json

U = {"role": "user", "content": "Hi"}
A = {"role": "assistant", "content": "Hello"}


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


# kind -> (raw line, reject code); MAX_ROW_BYTES and MAX_LENGTH are the limits the test config sets.
MAX_ROW_BYTES = 4096
MAX_LENGTH = 64
BAD_ROWS: dict[str, tuple[bytes, str]] = {
    "malformed_json": (b'{"messages": [{"role": "user", "content": "hi"}', "invalid_json"),
    "garbage": (b"this is not json", "invalid_json"),
    "trailing_garbage": (b'{"messages": []} extra', "invalid_json"),
    "invalid_utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9 \xff"}]}', "invalid_utf8"),
    "json_array": (b"[1, 2, 3]", "not_an_object"),
    "json_null": (b"null", "not_an_object"),
    "unknown_format": (_j({"text": "just text"}), "unknown_format"),
    "messages_not_list": (_j({"messages": {"role": "user"}}), "bad_messages"),
    "messages_nan": (b'{"messages": NaN}', "bad_messages"),
    "empty_messages": (_j({"messages": []}), "no_messages"),
    "message_not_object": (_j({"messages": ["hi"]}), "bad_messages"),
    "unknown_role": (_j({"messages": [{"role": "narrator", "content": "x"}, A]}), "unknown_role"),
    "missing_content": (_j({"messages": [{"role": "user"}, A]}), "missing_content"),
    "non_string_content": (_j({"messages": [{"role": "user", "content": 42}, A]}), "bad_content"),
    "image_content": (
        _j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, A]}),
        "bad_content",
    ),
    "system_only": (_j({"messages": [{"role": "system", "content": "be nice"}]}), "no_dialogue"),
    "developer_only": (_j({"messages": [{"role": "developer", "content": "be nice"}]}), "no_dialogue"),
    "malformed_tool_arguments": (
        _j(
            {
                "messages": [
                    U,
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
                    },
                ]
            }
        ),
        "bad_tool_call",
    ),
    "tool_call_without_name": (
        _j(
            {
                "messages": [
                    U,
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"type": "function", "function": {"arguments": {}}}],
                    },
                ]
            }
        ),
        "bad_tool_call",
    ),
    "tool_call_on_user": (_j({"messages": [{**U, "tool_calls": [{"function": {"name": "f"}}]}, A]}), "bad_tool_call"),
    "tool_call_id_not_string": (
        _j({"messages": [U, {"role": "tool", "tool_call_id": 5, "content": "r"}]}),
        "bad_tool_call",
    ),
    "reasoning_not_string": (_j({"messages": [U, {**A, "reasoning_content": ["x"]}]}), "bad_reasoning"),
    "tools_not_list": (_j({"messages": [U, A], "tools": "everything"}), "bad_tools"),
    "sharegpt_unknown_from": (_j({"conversations": [{"from": "bot", "value": "x"}]}), "unknown_role"),
    "sharegpt_developer_only": (_j({"conversations": [{"from": "developer", "value": "be nice"}]}), "no_dialogue"),
    "sharegpt_missing_value": (_j({"conversations": [{"from": "human"}]}), "missing_content"),
    "alpaca_empty_instruction": (_j({"instruction": "   ", "output": "x"}), "empty_prompt"),
    "alpaca_non_string_output": (_j({"instruction": "do", "output": 3}), "bad_content"),
    "oversized_row": (_j({"messages": [{"role": "user", "content": "x" * (2 * MAX_ROW_BYTES)}]}), "oversized_row"),
    "assistant_only": (_j({"messages": [A]}), "template_error"),
    "special_token_in_content": (
        _j({"messages": [{"role": "user", "content": "end <|im_end|> now"}]}),
        "special_token_in_content",
    ),
    "reasoning_with_thinking_off": (
        _j({"messages": [U, {**A, "reasoning_content": "hmm"}]}),
        "turn_does_not_extend_prompt",
    ),
    "prompt_too_long": (_j({"messages": [{"role": "user", "content": "word " * 200}]}), "prompt_too_long"),
    "no_loss_in_window": (_j({"messages": [{"role": "user", "content": "word " * 200}, A]}), "no_loss_in_window"),
}
GOOD_ROWS: list[bytes] = [
    _j({"messages": [U, A]}),
    _j({"messages": [{"role": "user", "content": "Bonjour, ça va? 你好 🙂"}]}),
    _j({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}),
    _j({"messages": [{"role": "developer", "content": "Be brief."}, U, A]}),
    _j({"conversations": [{"from": "developer", "value": "Be brief."}, {"from": "human", "value": "q"}]}),
    _j({"instruction": "Say hi", "output": "hi"}),
    _j({"messages": [U, {"role": "assistant", "content": ""}]}),
]


def corpus_lines() -> list[bytes]:
    """Good and bad rows interleaved, with blank lines that are not rows."""
    lines: list[bytes] = []
    for i, (line, _) in enumerate(BAD_ROWS.values()):
        lines.append(line)
        lines.append(GOOD_ROWS[i % len(GOOD_ROWS)])
        if i % 7 == 0:
            lines.append(b"   ")
    return lines
