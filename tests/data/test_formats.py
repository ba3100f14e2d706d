import pytest

from raypipe.data.formats import Reject, normalize


def test_openai_with_tools_reasoning_and_string_arguments():
    conv = normalize(
        {
            "id": 7,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "hm",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
        }
    )
    assert conv.id == "7"
    assert conv.messages[0]["content"] == "ab"
    assert conv.messages[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hm",
        "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert conv.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert conv.tools and conv.tools[0]["function"]["name"] == "f"


def test_sharegpt_roles_map():
    conv = normalize(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "tool", "value": "t"},
            ]
        }
    )
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conv.id is None


def test_alpaca_with_and_without_output():
    assert normalize({"instruction": "Do", "input": "this", "output": "done"}).messages == [
        {"role": "user", "content": "Do\n\nthis"},
        {"role": "assistant", "content": "done"},
    ]
    assert normalize({"instruction": "Do", "output": ""}).messages == [{"role": "user", "content": "Do"}]


@pytest.mark.parametrize(
    "record, code",
    [
        ([1, 2], "not_an_object"),
        ({"text": "hi"}, "unknown_format"),
        ({"messages": "hi"}, "bad_messages"),
        ({"messages": []}, "no_messages"),
        ({"messages": ["hi"]}, "bad_messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "Developer", "content": "x"}, {"role": "user", "content": "q"}]}, "unknown_role"),
        ({"messages": [{"role": "user"}]}, "missing_content"),
        ({"messages": [{"role": "user", "content": 5}]}, "bad_content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "bad_content"),
        ({"messages": [{"role": "system", "content": "only"}]}, "no_dialogue"),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                    },
                ]
            },
            "bad_tool_call",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
                ]
            },
            "bad_tool_call",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": []}]},
            "bad_tool_call",
        ),
        (
            {"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]}]},
            "bad_tool_call",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": 3},
                ]
            },
            "bad_reasoning",
        ),
        ({"messages": [{"role": "user", "content": "q"}], "tools": "all"}, "bad_tools"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown_role"),
        ({"conversations": [{"from": "dev", "value": "x"}, {"from": "human", "value": "q"}]}, "unknown_role"),
        ({"conversations": [{"from": "human"}]}, "missing_content"),
        ({"instruction": ""}, "empty_prompt"),
        ({"instruction": ["x"]}, "bad_content"),
    ],
)
def test_bad_records_are_rejected_with_a_code(record, code):
    with pytest.raises(Reject) as err:
        normalize(record)
    assert err.value.code == code
    assert err.value.stage == "normalize"
    assert err.value.reason


def test_declared_format_must_match():
    with pytest.raises(Reject, match="declared sharegpt"):
        normalize({"messages": [{"role": "user", "content": "q"}]}, "sharegpt")


def turns(fmt: str, *messages: tuple[str, str]) -> dict:
    """A record of (role, text) turns in `fmt`, with ShareGPT's own names for user and assistant."""
    if fmt == "openai":
        return {"messages": [{"role": role, "content": text} for role, text in messages]}
    names = {"user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names.get(role, role), "value": text} for role, text in messages]}


@pytest.mark.parametrize("fmt", ["openai", "sharegpt"])
@pytest.mark.parametrize("at", [0, 2], ids=["leading", "after_a_reply"])
def test_developer_is_read_as_system(fmt, at):
    dialogue = [("user", "q"), ("assistant", "a"), ("user", "q2")]
    convs = {
        role: normalize(turns(fmt, *dialogue[:at], (role, "Be brief."), *dialogue[at:]))
        for role in ("system", "developer")
    }
    assert convs["developer"] == convs["system"]
    assert convs["developer"].messages[at] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("fmt", ["openai", "sharegpt"])
def test_developer_only_is_refused_as_system_only_is(fmt):
    errors = {}
    for role in ("system", "developer"):
        with pytest.raises(Reject) as err:
            normalize(turns(fmt, (role, "Be brief.")))
        errors[role] = (err.value.stage, err.value.code, err.value.reason)
    assert errors["developer"] == errors["system"] and errors["system"][1] == "no_dialogue"


@pytest.mark.parametrize(
    "turn, code",
    [
        ({"content": "s", "weight": 0}, "bad_weight"),
        ({"content": "s", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, "bad_tool_call"),
        ({"content": "s", "reasoning_content": "hm"}, "bad_reasoning"),
        ({}, "missing_content"),
    ],
)
def test_a_developer_turn_refuses_what_a_system_turn_refuses(turn, code):
    """Same code; the reason quotes the role as the data spells it."""
    errors = {}
    for role in ("system", "developer"):
        with pytest.raises(Reject) as err:
            normalize({"messages": [{"role": role, **turn}, {"role": "user", "content": "q"}]})
        errors[role] = err.value
    assert errors["developer"].code == errors["system"].code == code
    assert errors["developer"].reason == errors["system"].reason.replace("system", "developer")


def test_an_unknown_role_names_the_roles_read():
    with pytest.raises(Reject, match="role 'dev' is not one of system, developer, user, assistant, tool"):
        normalize({"messages": [{"role": "dev", "content": "x"}, {"role": "user", "content": "q"}]})
    with pytest.raises(Reject, match="from 'Developer' is not one of system, developer, human"):
        normalize({"conversations": [{"from": "Developer", "value": "x"}, {"from": "human", "value": "q"}]})
