"""Tiny targets worth drafting for: small models of the production architectures trained in code on structured chat.

A randomly initialised model repeats one token, so any drafter "accepts"
trivially or never. These learn, in a few minutes on 2 CPU cores, to answer
generated requests whose replies follow from the prompt — copy, reverse,
repeat, pair up, count on, add — inside a Qwen-style chat template (raypipe's
`qwen_strict`, thinking off), with their own word-level vocabulary. Their
greedy replies vary with the context and a bigram model cannot predict them,
so a drafter is accepted only as far as it has learned to follow the target.

Two architectures, the same tasks, vocabulary and tokenizer:
- `qwen3` (`builtin:demo`): Qwen3-8B's, four attention layers.
- `qwen36` (`builtin:demo_qwen36`): Qwen3.6-27B's. A composite config
  (`text_config` + a one-layer `vision_config`), Gated DeltaNet
  (`linear_attention`) and gated full-attention layers in Qwen3.6's pattern,
  partial rotary 0.25 and the M-RoPE keys of the real config. A drafter that
  reaches the Qwen3 demo's acceptance on it shows the train/serve contract of
  Qwen3.6 holds where a random target (τ ≈ 1 whatever happens) cannot. Its
  tokenizer lives in `tokenizer/` (raypipe.target.tokenizer_path).

Deterministic from the seed, built once and cached (the directory appears
atomically); prompts for data, training and evaluation come from the same
generator with different seeds.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from raypipe.assets import TOKENIZER_DIR
from raypipe.assets.qwen_vocab import write_dir_atomically
from raypipe.assets.templates import load_template
from raypipe.console import logger
from raypipe.progress import progress

DEMO_TARGET_VERSION = "1"
ARCHITECTURES = ("qwen3", "qwen36")
_STAMP_FILE = "raypipe_demo_target.json"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>", "<unk>"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
DIGITS = list("0123456789")
WORDS = [
    "system",
    "user",
    "assistant",
    "\n",
    ":",
    ",",
    "+",
    "=",
    "copy",
    "reverse",
    "repeat",
    "twice",
    "pairs",
    "count",
    "from",
    "add",
    "please",
    "and",
    "then",
    "list",
    "numbers",
    "letters",
]
TASKS = ("copy", "reverse", "repeat", "pairs", "count", "add")
DEMO_SPLITS = {"train": (4000, 1), "heldout": (200, 2)}  # bundled under data/demo/: rows, generator seed


def vocabulary() -> list[str]:
    return SPECIALS + WORDS + LETTERS + DIGITS


def _number(n: int) -> str:
    return " ".join(str(n))


def make_request(rng: random.Random) -> tuple[str, str]:
    """One (user prompt, reply) pair; the reply is a function of the prompt."""
    task = rng.choice(TASKS)
    items = [rng.choice(LETTERS) for _ in range(rng.randint(3, 8))]
    text = " ".join(items)
    polite = "please " if rng.random() < 0.3 else ""
    if task == "copy":
        return f"{polite}copy : {text}", text
    if task == "reverse":
        return f"{polite}reverse : {text}", " ".join(reversed(items))
    if task == "repeat":
        return f"{polite}repeat twice : {text}", f"{text} {text}"
    if task == "pairs":
        return f"{polite}pairs : {text}", " ".join(f"{c} {c}" for c in items)
    if task == "count":
        start, n = rng.randint(0, 95), rng.randint(3, 6)
        return f"{polite}count from {_number(start)}", " , ".join(_number(start + k) for k in range(n))
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{polite}add {_number(a)} + {_number(b)}", f"{_number(a)} + {_number(b)} = {_number(a + b)}"


def make_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One or two user turns with the target's answers (the last answer is what a prompt-only row leaves out)."""
    messages = []
    for _ in range(1 if rng.random() < 0.7 else 2):
        prompt, reply = make_request(rng)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return messages


def demo_rows(count: int, seed: int, split: str, exclude: frozenset[str] = frozenset()) -> list[dict[str, object]]:
    """Prompt-only chat rows (openai format) from the generator: the target writes the replies.

    Earlier turns keep the generator's answer (which the target reproduces); the
    last user turn is open, so the data stage marks the row `needs_response`.
    Seeds differ from the target's own training stream (seed 0) and between
    splits; conversations in `exclude` (JSON of their messages) are skipped.
    """
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    while len(rows) < count:
        messages = make_conversation(rng)[:-1]
        if json.dumps(messages) not in exclude:
            rows.append({"id": f"demo-{split}-{len(rows):06d}", "messages": messages})
    return rows


def task_of(prompt: str) -> str:
    """The generator's task a user prompt asks for (copy, reverse, ..., add)."""
    return prompt.removeprefix("please ").split()[0]


def demo_splits() -> dict[str, list[dict[str, object]]]:
    """The bundled demo data: training prompts, and held-out prompts none of which occurs in training; each held-out
    prompt's `category` is the task of its open turn, so the evaluation reports τ per task."""
    train = demo_rows(*DEMO_SPLITS["train"], "train")
    seen = frozenset(json.dumps(r["messages"]) for r in train)
    heldout = demo_rows(*DEMO_SPLITS["heldout"], "heldout", exclude=seen)
    for row in heldout:
        row["category"] = task_of(row["messages"][-1]["content"])
    return {"train": train, "heldout": heldout}


def build_tokenizer() -> object:
    """A word-level fast tokenizer over the demo vocabulary, with the strict Qwen-style template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("\n"), "isolated"), pre_tokenizers.Split(Regex(" +"), "removed")]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    tok.chat_template = load_template("qwen_strict")
    return tok


def demo_target_config(vocab_size: int, arch: str = "qwen3") -> object:
    """The demo target's config: Qwen3's, or Qwen3.6's composite one (`demo_qwen36_config`)."""
    from transformers import Qwen3Config

    tok_ids = {t: i for i, t in enumerate(vocabulary())}
    if arch == "qwen36":
        return demo_qwen36_config(vocab_size, tok_ids)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=tok_ids["<|endoftext|>"],
        eos_token_id=tok_ids["<|im_end|>"],
        pad_token_id=tok_ids["<|endoftext|>"],
        dtype="float32",
    )


def demo_qwen36_config(vocab_size: int, tok_ids: dict[str, int]) -> object:
    """Qwen3.6's architecture (raypipe.assets.tiny_target.qwen36_config) at the Qwen3 demo's depth and widths, with
    the demo's vocabulary; image and video token ids lie past it: text never contains them."""
    from raypipe.assets.tiny_target import qwen36_config

    return qwen36_config(
        {
            "vocab_size": vocab_size,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "max_position_embeddings": 512,
            "bos_token_id": tok_ids["<|endoftext|>"],
            "eos_token_id": tok_ids["<|im_end|>"],
            "pad_token_id": tok_ids["<|endoftext|>"],
        },
        (vocab_size, vocab_size + 1, vocab_size + 2, vocab_size + 3),
    )


def encode(tok: object, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    """(token ids of the whole conversation, length of the prompt before the last reply)."""
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, enable_thinking=False, tokenize=False)
    full = tok.apply_chat_template(messages, enable_thinking=False, tokenize=False)
    assert full.startswith(prompt)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tok(full[len(prompt) :].rstrip("\n"), add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids, len(prompt_ids)


def train_demo_target(directory: Path, seed: int, arch: str = "qwen3", steps: int = 600, batch: int = 48) -> None:
    """Train from scratch on generated conversations (loss on the last reply) and save model + tokenizer."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3ForCausalLM

    tok = build_tokenizer()
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_class = Qwen3_5ForConditionalGeneration if arch == "qwen36" else Qwen3ForCausalLM
        model = model_class(demo_target_config(len(tok), arch))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.05)
        model.train()
        bar = progress(steps, f"[demo target {arch}] training", "steps")
        for _ in range(steps):
            rows = [encode(tok, make_conversation(rng)) for _ in range(batch)]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.full((batch, width), tok.pad_token_id)
            labels = torch.full((batch, width), -100)
            for i, (row, prompt_len) in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
                labels[i, prompt_len : len(row)] = torch.tensor(row[prompt_len:])
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update()
        bar.close()
    model.save_pretrained(directory)
    # A qwen3_5 model's folder would load Qwen's byte-level BPE class instead (raypipe.target.tokenizer_path).
    tok.save_pretrained(directory / TOKENIZER_DIR if arch == "qwen36" else directory)


def build_demo_target(output_dir: str | os.PathLike[str], seed: int = 0, arch: str = "qwen3") -> Path:
    """Train and write the demo target of `arch` to `output_dir` once (atomically); later calls reuse it."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown demo target architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    out = Path(output_dir).expanduser()
    stamp = {"version": DEMO_TARGET_VERSION, "seed": seed, "arch": arch}
    stamp_file = out / _STAMP_FILE
    if not stamp_file.is_file():
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty and holds no demo target; pass a new or empty directory")

        logger("demo_target").info(f"not built yet: training it once ({arch}), into {out}")

        def write(tmp: Path) -> None:
            train_demo_target(tmp, seed, arch)
            (tmp / _STAMP_FILE).write_text(json.dumps(stamp))

        write_dir_atomically(out, write)
    found = {"arch": "qwen3", **json.loads(stamp_file.read_text())}  # builds before `arch` existed were Qwen3
    if found != stamp:
        raise ValueError(
            f"{out} holds a demo target built with {found}, not {stamp}; remove it or pass the seed it was built with"
        )
    return out
