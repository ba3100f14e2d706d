"""The demo target is worth drafting for: its greedy replies vary with the prompt and a bigram model cannot predict
them."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
import torch

from raypipe.assets.demo_target import build_demo_target, build_tokenizer, encode, make_conversation, make_request


def greedy_replies(model_dir: str, prompts: list[str], max_new_tokens: int = 40) -> list[list[int]]:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, enable_thinking=False, tokenize=False
        )
        for p in prompts
    ]
    batch = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    replies = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        replies.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return replies


@pytest.mark.integration
def test_greedy_replies_are_varied_and_not_bigram_predictable(demo_target: str) -> None:
    rng = random.Random(10_000)  # held out: the target trained on the stream of seed 0
    prompts = [make_request(rng)[0] for _ in range(100)]
    replies = greedy_replies(demo_target, prompts)
    assert len({tuple(r) for r in replies}) >= 90

    tok = build_tokenizer()
    train_rng = random.Random(0)
    bigram: dict[int, Counter] = defaultdict(Counter)
    for _ in range(5000):
        ids, prompt_len = encode(tok, make_conversation(train_rng))
        reply = ids[prompt_len:]
        for a, b in zip(reply, reply[1:]):
            bigram[a][b] += 1
    predicted = total = 0
    for reply in replies:
        for a, b in zip(reply, reply[1:]):
            total += 1
            predicted += bool(bigram[a]) and bigram[a].most_common(1)[0][0] == b
    assert predicted / total < 0.5, f"a bigram model predicts {predicted}/{total} reply tokens"


@pytest.mark.integration
def test_the_build_is_cached_and_refuses_another_seed(demo_target: str) -> None:
    assert str(build_demo_target(demo_target)) == demo_target
    with pytest.raises(ValueError, match="seed"):
        build_demo_target(demo_target, seed=1)


def test_training_is_deterministic(tmp_path) -> None:
    from raypipe.assets.demo_target import train_demo_target

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        train_demo_target(tmp_path / name, seed=3, steps=2, batch=4)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_the_qwen36_demo_target_has_qwen36s_architecture_and_the_demo_vocabulary(tmp_path) -> None:
    """What builtin:demo_qwen36 is, from a two-step build (the full build takes minutes: docs/benchmarks_log.md,
    issue 38)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from raypipe.assets.demo_target import build_demo_target, train_demo_target, vocabulary
    from raypipe.target import tokenizer_path

    train_demo_target(tmp_path, seed=3, arch="qwen36", steps=2, batch=4)
    config = AutoConfig.from_pretrained(tmp_path)
    text = config.get_text_config()
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"] and config.vision_config.depth == 1
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] and text.vocab_size == len(vocabulary())
    rope = text.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_section"] == [2, 1, 1] and rope["mrope_interleaved"]
    assert config.image_token_id >= text.vocab_size  # the demo's text never holds a media token
    tok = build_tokenizer()
    ids, _ = encode(tok, make_conversation(random.Random(1)))
    # AutoTokenizer gives a qwen3_5 model's folder Qwen's byte-level BPE class, which splits the words into letters;
    # the tokenizer's own folder (what vLLM and raypipe load) keeps the word vocabulary.
    saved = AutoTokenizer.from_pretrained(tokenizer_path(str(tmp_path)))
    assert tokenizer_path(str(tmp_path)) == str(tmp_path / "tokenizer") and saved.mask_token_id == tok.mask_token_id
    assert saved.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids) and saved(tok.decode(ids))["input_ids"]
    text = "copy : a b c"
    assert saved(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # the language model alone, as the canary loads it
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids])).logits).all()
    (tmp_path / "raypipe_demo_target.json").write_text('{"version": "1", "seed": 3, "arch": "qwen36"}')
    with pytest.raises(ValueError, match="qwen3"):
        build_demo_target(tmp_path, seed=3)  # a Qwen3.6 build is never taken for the Qwen3 demo target


def test_the_data_stage_prepares_demo_conversations_with_the_demo_vocabulary(tmp_path) -> None:
    import json

    from raypipe.data.prepare import ShardPreparer
    from raypipe.data.sources import plan_chunks
    from raypipe.data.tokenizer import resolve_tokenizer
    from tests.helpers import data_config

    rng = random.Random(5)
    conversations = [c for c in (make_conversation(rng) for _ in range(60)) if len(c) == 2][
        :20
    ]  # one turn: no per-turn split
    rows = [{"messages": c} for c in conversations[:10]] + [
        {"messages": c[:-1]} for c in conversations[10:]
    ]  # the second half prompt-only
    path = tmp_path / "demo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = data_config(sources=[{"path": str(path)}], output=str(tmp_path / "out"), tokenizer="builtin:demo")
    tok, spec = resolve_tokenizer(cfg)
    [chunk] = plan_chunks(cfg.sources, {}, 1 << 30)
    table = ShardPreparer(cfg, spec).prepare(chunk).table
    assert table.num_rows == 20 and table.column("needs_response").to_pylist() == [False] * 10 + [True] * 10
    for ids, mask, messages in zip(
        table.column("input_ids").to_pylist()[:10], table.column("loss_mask").to_pylist(), conversations
    ):
        assert tok.unk_token_id not in ids
        trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True).split()
        assert trained == " ".join(m["content"] for m in messages if m["role"] == "assistant").split()


def test_the_bundled_demo_data_is_what_the_generator_writes() -> None:
    import json
    from pathlib import Path

    from raypipe.assets.demo_target import demo_splits

    root = Path(__file__).resolve().parents[2] / "data" / "demo"
    splits = demo_splits()
    for split, rows in splits.items():
        lines = (root / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows, "regenerate with `python scripts/make_demo_data.py`"
    train = {json.dumps(r["messages"]) for r in splits["train"]}
    assert not any(json.dumps(r["messages"]) in train for r in splits["heldout"])
    assert len(splits["heldout"]) == 200 and len(splits["train"]) == 4000
