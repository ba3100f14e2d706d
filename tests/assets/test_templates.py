"""Chat templates: the strict Qwen behaviours, exact generation masks, and permissive ChatML."""

import re
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerFast

from raypipe.assets.templates import TEMPLATE_NAMES, load_template

Message = dict[str, Any]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_SYSTEM_TAIL = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def render(tokenizer: PreTrainedTokenizerFast, name: str, messages: list[Message], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=load_template(name), **kwargs)


def strict(tokenizer: PreTrainedTokenizerFast, messages: list[Message], **kwargs: Any) -> str:
    return render(tokenizer, "qwen_strict", messages, **kwargs)


# --- loading ---------------------------------------------------------------------------------------


def test_every_named_template_loads() -> None:
    assert TEMPLATE_NAMES == ("qwen_strict", "generation_markers", "chatml")
    assert all("<|im_start|>" in load_template(name) for name in TEMPLATE_NAMES)


def test_unknown_template_names_the_choices() -> None:
    with pytest.raises(ValueError, match="qwen_strict, generation_markers, chatml"):
        load_template("llama3")


# --- qwen_strict -----------------------------------------------------------------------------------


def test_strict_user_only_generation_prompt(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = strict(qwen_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_strict_thinking_on_adds_nothing_to_prompt(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    on = strict(qwen_tokenizer, messages, add_generation_prompt=True, enable_thinking=True)
    assert on == strict(qwen_tokenizer, messages, add_generation_prompt=True)


def test_strict_thinking_off_adds_empty_think_block(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = strict(
        qwen_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_strict_system_turn_first(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = strict(qwen_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_strict_tools_go_into_system_turn(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = strict(qwen_tokenizer, messages, tools=TOOLS)
    assert text == "<|im_start|>system\nBe brief.\n\n" + TOOLS_SYSTEM_TAIL + "<|im_start|>user\nHi<|im_end|>\n"


def test_strict_tools_without_system_message(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = strict(qwen_tokenizer, [{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert text == "<|im_start|>system\n" + TOOLS_SYSTEM_TAIL + "<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "S"}],
        [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}],
    ],
)
def test_strict_without_user_query_raises(qwen_tokenizer: PreTrainedTokenizerFast, messages: list[Message]) -> None:
    with pytest.raises(TemplateError, match=r"^No user query found in messages\.$"):
        strict(qwen_tokenizer, messages, add_generation_prompt=True)


def test_strict_reasoning_kept_only_after_last_query(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
    ]
    assert strict(qwen_tokenizer, messages) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    )


def test_strict_reasoning_parsed_from_content(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
    ]
    assert strict(qwen_tokenizer, messages) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    )


def test_strict_last_assistant_always_gets_think_block(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert strict(qwen_tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    )


def test_strict_tool_response_is_not_a_user_query(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    """Reasoning of every step in a tool loop survives: only the real query counts."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "R1",
            "tool_calls": [call("get_weather", city="Oslo")],
        },
        {"role": "user", "content": "<tool_response>\n-3\n</tool_response>"},
        {"role": "assistant", "content": "Cold.", "reasoning_content": "R2"},
    ]
    text = strict(qwen_tokenizer, messages)
    assert "<think>\nR1\n</think>\n\n<tool_call>" in text and "<think>\nR2\n</think>\n\nCold." in text


def test_strict_tool_call_round_trip(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call the tool.",
            "tool_calls": [call("get_weather", city="Paris")],
        },
        {"role": "tool", "content": "18°C", "tool_call_id": "c1"},
        {"role": "assistant", "content": "18°C in Paris."},
    ]
    assert strict(qwen_tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n18°C in Paris.<|im_end|>\n"
    )


def test_strict_tool_calls_follow_content(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    calls = [
        call("get_weather", city="Zürich"),
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
    ]
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    assert strict(qwen_tokenizer, messages).endswith(
        "Checking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
    )


def test_strict_earlier_tool_step_without_reasoning_has_no_think(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Rome")]},
        {"role": "tool", "content": "20"},
    ]
    assert strict(qwen_tokenizer, messages).startswith(
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    )


def test_strict_accepts_null_content_with_tool_calls(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None, "tool_calls": [call("a")]}]
    assert strict(qwen_tokenizer, messages).endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "a", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
    )


def test_strict_consecutive_tool_messages_merge(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
        {"role": "tool", "content": "ra", "tool_call_id": "1"},
        {"role": "tool", "content": "rb", "tool_call_id": "2"},
    ]
    assert strict(qwen_tokenizer, messages).endswith(
        "<|im_start|>user\n<tool_response>\nra\n</tool_response>\n<tool_response>\nrb\n</tool_response><|im_end|>\n"
    )


def test_strict_unknown_role_raises(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(TemplateError, match="Unexpected message role: narrator"):
        strict(qwen_tokenizer, [{"role": "user", "content": "Q"}, {"role": "narrator", "content": "N"}])


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_strict_prompt_is_prefix_of_final_reply(qwen_tokenizer: PreTrainedTokenizerFast, enable_thinking: bool) -> None:
    """The data stage finds reply boundaries by rendering the prompt alone; that must be a prefix."""
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    reply = {"role": "assistant", "content": "A", "tool_calls": [call("get_weather", city="Oslo")]}
    kwargs = {"enable_thinking": enable_thinking}
    head = strict(qwen_tokenizer, prompt, add_generation_prompt=True, **kwargs)
    full = strict(qwen_tokenizer, [*prompt, reply], **kwargs)
    assert full.startswith(head) and full.endswith("</tool_call><|im_end|>\n")


def test_strict_has_no_generation_markers() -> None:
    assert re.search(r"\{%-?\s*generation\s*-?%\}", load_template("qwen_strict")) is None
    assert re.search(r"\{%-?\s*generation\s*-?%\}", load_template("generation_markers"))


# --- generation_markers ----------------------------------------------------------------------------

MARKED = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Oslo")]},
    {"role": "tool", "content": "-3"},
    {"role": "assistant", "content": "Cold: -3."},
]
MARKED_REPLIES = [
    "<think>\nAdd them.\n</think>\n\nIt is 4.<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
    "Cold: -3.<|im_end|>",
]


def test_markers_render_history_unchanged(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    assert render(qwen_tokenizer, "generation_markers", MARKED) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        f"<|im_start|>assistant\n{MARKED_REPLIES[0]}\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{MARKED_REPLIES[1]}\n"
        "<|im_start|>user\n<tool_response>\n-3\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{MARKED_REPLIES[2]}\n"
    )


def test_markers_mask_exactly_the_assistant_text(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    out = qwen_tokenizer.apply_chat_template(
        MARKED,
        chat_template=load_template("generation_markers"),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    spans: list[tuple[int, int]] = []
    for i, bit in enumerate(mask):
        if bit and (i == 0 or not mask[i - 1]):
            spans.append((i, i))
        if bit:
            spans[-1] = (spans[-1][0], i + 1)
    assert [qwen_tokenizer.decode(ids[a:b]) for a, b in spans] == MARKED_REPLIES
    for a, b in spans:
        assert ids[a - 3 : a] == [151644, 77091, 198]  # <|im_start|>assistant\n stays unmasked
        assert ids[b - 1] == 151645 and ids[b] == 198  # <|im_end|> masked, the newline after it not


def test_markers_tools_block(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(qwen_tokenizer, "generation_markers", MARKED, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nS\n\n" + TOOLS_SYSTEM_TAIL + "<|im_start|>user\nWhat is 2+2?")


def test_markers_never_require_a_user_query(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(
        qwen_tokenizer, "generation_markers", [{"role": "assistant", "content": "A"}], add_generation_prompt=True
    )
    assert text == "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n"


# --- chatml ----------------------------------------------------------------------------------------


def test_chatml_renders_any_roles_in_order(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "assistant", "content": "A"},
        {"role": "narrator", "content": "N"},
        {"role": "system", "content": "S"},
        {"role": "tool", "content": "T"},
    ]
    assert render(qwen_tokenizer, "chatml", messages, add_generation_prompt=True) == (
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>narrator\nN<|im_end|>\n"
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_appends_tool_calls(qwen_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "assistant", "content": "On it.", "tool_calls": [call("get_weather", city="Oslo")]}]
    assert render(qwen_tokenizer, "chatml", messages) == (
        "<|im_start|>assistant\nOn it.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    )
