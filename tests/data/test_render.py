"""The documented result of every strict-template case, and the mask boundaries."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.data.formats import Reject, normalize
from tests.helpers import prepare_records, qwen_spec, renderer

USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4"}


def conv(*messages, tools=None):
    record = {"messages": list(messages)}
    if tools:
        record["tools"] = tools
    return normalize(record)


def supervised_text(seg):
    return "".join(t for t, s in seg.pieces if s)


def prompt_text(seg):
    return "".join(t for t, _ in seg.pieces[: seg.prompt_pieces])


def test_prompt_only_gets_an_unsupervised_placeholder():
    [seg] = renderer(placeholder="PLACEHOLDER").segment(conv(USER))
    assert seg.needs_response and seg.turn is None
    assert supervised_text(seg) == ""
    assert prompt_text(seg).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "".join(t for t, _ in seg.pieces).endswith("PLACEHOLDER<|im_end|>\n")


def test_prompt_only_row_has_no_loss_and_prompt_len_ends_at_the_generation_prompt(tmp_path):
    result = prepare_records(tmp_path, [{"messages": [USER]}])
    [row] = result.table.to_pylist()
    tok, _ = qwen_spec()
    prompt = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert row["needs_response"] and row["num_loss_tokens"] == 0 and sum(row["loss_mask"]) == 0
    assert row["input_ids"][: row["prompt_len"]] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(row["input_ids"][row["prompt_len"] :]) == "OK.<|im_end|>\n"


def test_single_turn_supervises_reply_through_end_of_turn_only():
    [seg] = renderer().segment(conv(USER, ANSWER))
    assert not seg.needs_response
    assert supervised_text(seg) == "4<|im_end|>"
    assert seg.pieces[-1] == ("\n", False)  # the template's text after the end-of-turn token is not trained on


def test_conversation_ending_in_tool_results_gets_a_placeholder_after_them():
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
    }
    tools = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}]
    rows = renderer().segment(conv(USER, call, {"role": "tool", "tool_call_id": "c", "content": "4"}, tools=tools))
    assert rows[-1].needs_response
    assert "<tool_response>\n4\n</tool_response>" in prompt_text(rows[-1])
    supervised = [supervised_text(r) for r in rows if not r.needs_response] or [supervised_text(rows[0])]
    assert any(s.startswith("<tool_call>\n") and s.endswith("</tool_call><|im_end|>") for s in supervised)


def test_system_only_is_rejected_with_a_reason():
    with pytest.raises(Reject) as err:
        normalize({"messages": [{"role": "system", "content": "You are helpful."}]})
    assert err.value.code == "no_dialogue"


def test_assistant_only_is_rejected_with_the_template_message():
    with pytest.raises(Reject) as err:
        renderer().segment(conv(ANSWER))
    assert err.value.code == "template_error"
    assert "No user query found in messages." in err.value.reason


def test_assistant_first_keeps_the_leading_turn_as_context():
    rows = renderer().segment(conv({"role": "assistant", "content": "Hello! Ask me."}, USER, ANSWER))
    supervised = [supervised_text(r) for r in rows]
    assert "4<|im_end|>" in supervised
    assert not any("Hello! Ask me." in s for s in supervised)
    assert any("Hello! Ask me." in "".join(t for t, _ in r.pieces) for r in rows)


def test_reasoning_before_the_last_query_falls_back_to_per_turn_rows():
    messages = [
        USER,
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "three plus three"},
    ]
    rows = renderer(thinking=True).segment(conv(*messages))
    assert [r.turn for r in rows] == [1, 3]
    assert supervised_text(rows[0]) == "<think>\ntwo plus two\n</think>\n\n4<|im_end|>"
    assert supervised_text(rows[1]) == "<think>\nthree plus three\n</think>\n\n6<|im_end|>"
    assert "two plus two" not in prompt_text(rows[1])  # as the engine sees turn 3's prompt: earlier reasoning dropped


def test_qwen_multi_turn_without_thinking_is_per_turn_because_think_blocks_are_rewritten():
    rows = renderer().segment(
        conv(USER, ANSWER, {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"})
    )
    assert [supervised_text(r) for r in rows] == ["4<|im_end|>", "6<|im_end|>"]
    assert all(prompt_text(r).endswith("<think>\n\n</think>\n\n") for r in rows)


def test_chatml_multi_turn_renders_once():
    [row] = renderer("chatml").segment(
        conv(USER, ANSWER, {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"})
    )
    assert row.turn is None
    assert [t for t, s in row.pieces if s] == ["4<|im_end|>", "6<|im_end|>"]


def test_reasoning_while_thinking_is_off_is_rejected_with_the_fix():
    with pytest.raises(Reject, match="enable_thinking"):
        renderer().segment(conv(USER, {"role": "assistant", "content": "4", "reasoning_content": "sum"}))


def test_content_spelling_a_special_token_is_rejected():
    with pytest.raises(Reject) as err:
        renderer().segment(conv({"role": "user", "content": "hi <|im_end|> there"}))
    assert err.value.code == "special_token_in_content" and "<|im_end|>" in err.value.reason


def test_reply_starting_with_newline_is_not_merged_into_the_prompt(tmp_path):
    """BPE would merge the prompt's final newline with the reply's; the engine never emits that token."""
    result = prepare_records(
        tmp_path, [{"messages": [USER, {"role": "assistant", "content": "\nHello"}]}], chat_template="chatml"
    )
    [row] = result.table.to_pylist()
    tok, _ = qwen_spec("chatml")
    reply = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert reply == tok("\nHello<|im_end|>", add_special_tokens=False)["input_ids"]
    assert row["input_ids"][row["prompt_len"] - 1] == tok("\n")["input_ids"][0]
    whole = tok(tok.decode(row["input_ids"]), add_special_tokens=False)["input_ids"]
    assert whole != row["input_ids"]  # the naive single tokenization differs exactly here


def test_generation_marker_template_masks_reply_and_end_of_turn():
    [seg] = renderer("generation_markers").segment(conv(USER, ANSWER))
    assert supervised_text(seg) == "4<|im_end|>"


def test_the_faster_sandbox_still_refuses_unsafe_calls():
    from raypipe.data.render import ChatRenderer

    chat = ChatRenderer(
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages.pop() }}", {}, "<|im_end|>", "OK.", []
    )
    with pytest.raises(Reject, match="unsafe"):
        chat.segment(conv(USER, ANSWER))


_SPECIAL_BITS = ["<|im_end|>", "<|im_start|>", "</think>", "<think>", "<|im_", "/", "\\", "é", "\n", '"', "a"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(_SPECIAL_BITS), max_size=6).map("".join), min_size=1, max_size=4),
    st.booleans(),
    st.booleans(),
)
def test_a_line_the_raw_screen_passes_holds_no_special_token(texts, ensure_ascii, escape_slashes):
    """`spells_no_special` is only ever a shortcut: whenever it passes a JSON line (however it was encoded), the
    strings-by-strings check of that line's conversation passes too."""
    chat = renderer()
    record = {"messages": [{"role": "user", "content": t} for t in texts]}
    line = json.dumps(record, ensure_ascii=ensure_ascii)
    if escape_slashes:
        line = line.replace("/", "\\/")
    if chat.spells_no_special(line.encode()):
        try:
            chat.segment(normalize(json.loads(line)))
        except Reject as rej:
            assert not rej.code.startswith("special_token"), rej.reason
    else:  # refused only for a verbatim special token or an escape that could write one; the full check decides
        assert "\\u" in line or "\\/" in line or chat.raw_reserved.search(line.encode())
