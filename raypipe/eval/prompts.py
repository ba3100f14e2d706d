"""Held-out prompts for the evaluation, rendered exactly as the data stage renders a generation prompt.

Rows are read in file order from `eval.prompts` (JSONL in any format the data
stage accepts). A trailing assistant turn is the reference reply and is
dropped; what remains is rendered with the run's tokenizer, chat template and
thinking setting, with the generation prompt appended. A row that cannot be
used is an error naming the row: evaluation prompts are few and chosen.
A row may carry a `category` (the paper reports math, code and chat apart):
the evaluation then reports τ and speed per category.
"""

from __future__ import annotations

import json

import fsspec

from raypipe.config import RaypipeConfig, fingerprint
from raypipe.data.formats import Reject, normalize
from raypipe.data.tokenizer import resolve_tokenizer


def read_prompt_rows(url: str, count: int, storage_options: dict) -> list[tuple[str, dict]]:
    """The first `count` rows as (where, record), across the files a glob matches in sorted order."""
    files = sorted(fsspec.open_files(url, "rt", **storage_options), key=lambda f: f.path)
    if not files:
        raise ValueError(f"eval.prompts: no file matches {url}")
    rows = []
    for f in files:
        with f as stream:
            for line_no, line in enumerate(stream, 1):
                if line.strip():
                    where = f"{f.path}:{line_no}"
                    try:
                        rows.append((where, json.loads(line)))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"eval.prompts: {where} is not JSON ({err})") from None
                    if len(rows) == count:
                        return rows
    return rows


def prompts_digest(cfg: RaypipeConfig) -> str:
    """A digest of the rows the evaluation reads (the first eval.num_prompts), by content: a prompts file rewritten in
    place re-runs the evaluation, a row past those it reads does not."""
    rows = read_prompt_rows(cfg.eval.prompts, cfg.eval.num_prompts, cfg.data.storage_options)
    return fingerprint([record for _, record in rows])


UNCATEGORIZED = "uncategorized"


def categories_of(records: list[dict]) -> dict[str, list[int]] | None:
    """Row positions per `category` field (math, code, chat, ...), in first-seen order; None when no row has one.
    Rows without a category, beside rows with one, form their own group."""
    if not any("category" in r for r in records):
        return None
    groups: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        groups.setdefault(str(record.get("category", UNCATEGORIZED)), []).append(i)
    return groups


def load_prompts(cfg: RaypipeConfig) -> tuple[list[str], list[list[int]], dict[str, list[int]] | None]:
    """(row ids, prompt token ids, prompt positions per category or None) of the first eval.num_prompts held-out
    conversations."""
    tok, _ = resolve_tokenizer(cfg.data)
    ids, prompts, records = [], [], []
    for where, record in read_prompt_rows(cfg.eval.prompts, cfg.eval.num_prompts, cfg.data.storage_options):
        try:
            conv = normalize(record)
        except Reject as err:
            raise ValueError(f"eval.prompts: {where}: {err}") from None
        messages = conv.messages[:-1] if conv.messages[-1]["role"] == "assistant" else conv.messages
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            raise ValueError(
                f"eval.prompts: {where} has no user turn to answer; give conversations that end with a user turn (or a "
                "reply to drop)"
            )
        text = tok.apply_chat_template(
            messages,
            tools=conv.tools,
            add_generation_prompt=True,
            enable_thinking=cfg.data.enable_thinking,
            tokenize=False,
        )
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        if len(prompt) + cfg.eval.max_tokens > cfg.serve.max_model_len:
            raise ValueError(
                f"eval.prompts: {where} has {len(prompt)} prompt tokens; with eval.max_tokens={cfg.eval.max_tokens} "
                f"it exceeds serve.max_model_len={cfg.serve.max_model_len}"
            )
        ids.append(conv.id or where)
        prompts.append(prompt)
        records.append(record)
    return ids, prompts, categories_of(records)
