"""A rejected row's record: where it was, why it was refused, and its first bytes, written so nothing is lost."""

from __future__ import annotations

import base64
import json
from typing import Any

from raypipe.data.formats import Reject
from raypipe.data.sources import Chunk, Oversized

RAW_BYTES = 4096  # bytes of a raw row kept in its reject record
Raw = bytes | Oversized | dict[str, Any]


def tokenizer_reject(texts: list[str], err: Exception) -> Reject:
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            return Reject(
                "tokenize",
                "lone_surrogate",
                f"text holds {text[bad.start]!r}, a lone UTF-16 surrogate (an escape like \\ud800 in the JSON)",
            )
    return Reject("tokenize", "tokenizer_error", f"the tokenizer refused the row: {type(err).__name__}: {err}")


def safe(text: str) -> str:
    """`text` writable as UTF-8: lone surrogates become backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def reject_record(chunk: Chunk, url: str, sample_id: str, position: int, raw: Raw, rej: Reject) -> dict[str, Any]:
    """Everything needed to find, understand and recover the row: file and position, and its first bytes."""
    record: dict[str, Any] = {
        "sample_id": safe(sample_id),
        "source": chunk.source,
        "file": url,
        "position": position,
        "stage": rej.stage,
        "code": rej.code,
        "reason": safe(rej.reason),
    }
    if isinstance(raw, Oversized):
        data, size = raw.head, raw.size
    else:
        data = (
            json.dumps(raw, ensure_ascii=False, default=str).encode("utf-8", "backslashreplace")
            if isinstance(raw, dict)
            else raw
        )
        size = len(data)
    head = data[:RAW_BYTES]
    if size > len(head):
        record["raw_truncated"], record["raw_bytes"] = True, size
    try:
        record["raw"] = head.decode("utf-8").rstrip("\n")
    except UnicodeDecodeError as err:
        if size > len(head) and err.reason == "unexpected end of data":  # the cut split a character
            record["raw"] = head[: err.start].decode("utf-8")
        else:
            record["raw_base64"] = base64.b64encode(head).decode()
    return record
