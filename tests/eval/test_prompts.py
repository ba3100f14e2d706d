"""Evaluation prompts are rendered as the data stage renders a generation prompt; unusable rows are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypipe.assets.demo_target import build_tokenizer
from raypipe.config import load_config
from raypipe.eval.prompts import load_prompts


def _cfg(path: Path, *overrides: str):
    return load_config("demo", [f"eval.prompts={path}", *overrides])


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trailing_reply_is_dropped_and_the_generation_prompt_appended(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "copy : a b"}, {"role": "assistant", "content": "a b"}]},
        {"id": "b", "messages": [{"role": "user", "content": "copy : a b"}]},
        {"conversations": [{"from": "human", "value": "add 1 + 2"}]},
    ]
    ids, prompts, groups = load_prompts(_cfg(_write(tmp_path / "p.jsonl", rows), "eval.num_prompts=2"))
    assert ids == ["a", "b"] and groups is None
    assert prompts[0] == prompts[1]
    tok = build_tokenizer()
    assert tok.convert_ids_to_tokens(prompts[0]) == [
        "<|im_start|>",
        "user",
        "\n",
        "copy",
        ":",
        "a",
        "b",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant",
        "\n",
        "<think>",
        "\n",
        "\n",
        "</think>",
        "\n",
        "\n",
    ]


def test_the_bundled_heldout_prompts_load_with_their_categories() -> None:
    ids, prompts, groups = load_prompts(load_config("demo"))
    assert len(prompts) == 100 and len(set(ids)) == 100 and all(i.startswith("demo-heldout-") for i in ids)
    assert set(groups) == {"copy", "reverse", "repeat", "pairs", "count", "add"}
    assert sorted(i for positions in groups.values() for i in positions) == list(range(100))


def test_rows_without_a_category_beside_rows_with_one_form_their_own_group(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "add 1 + 2"}], "category": "math"},
        {"messages": [{"role": "user", "content": "copy : a"}]},
        {"messages": [{"role": "user", "content": "add 3 + 4"}], "category": "math"},
    ]
    _, _, groups = load_prompts(_cfg(_write(tmp_path / "p.jsonl", rows)))
    assert groups == {"math": [0, 2], "uncategorized": [1]}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "a"}]},
            "no user turn",
        ),
        ({"prompt": "hi"}, "unknown_format"),
    ],
)
def test_an_unusable_row_is_an_error_naming_it(tmp_path: Path, row: dict, message: str) -> None:
    path = _write(tmp_path / "p.jsonl", [row])
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(_cfg(path))
    assert f"{path}:1" in str(err.value)


def test_a_prompt_too_long_for_the_engine_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": " ".join(["a"] * 600)}]}])
    with pytest.raises(ValueError, match="exceeds serve.max_model_len"):
        load_prompts(_cfg(path))
