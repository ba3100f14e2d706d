"""Bounded inputs: a bad request gets an error naming the problem, and the engine never sees it."""

from __future__ import annotations

from typing import Any


class BadRequest(ValueError):
    """A request the service refuses; the replica stays healthy."""


def validate_batch(
    batch: Any, *, vocab_size: int, max_len: int, max_sequences: int, max_tokens: int
) -> list[list[int]]:
    """A list of non-empty token-id lists, each id in [0, vocab_size), each shorter than max_len (the engine's
    `max_model_len`): vLLM generates at least one token after every prompt, extraction included, and refuses a prompt
    that leaves no room for it with an engine exception; here it is a named refusal instead."""
    if not isinstance(batch, list) or not batch:
        raise BadRequest(f"expected a non-empty list of token-id lists, got {type(batch).__name__}")
    if len(batch) > max_sequences:
        raise BadRequest(f"{len(batch)} sequences in one request; at most {max_sequences}, split the request")
    total = 0
    for i, seq in enumerate(batch):
        if not isinstance(seq, list):
            raise BadRequest(f"sequence {i} must be a list of ints, got {type(seq).__name__}")
        if not seq:
            raise BadRequest(f"sequence {i} is empty")
        if len(seq) >= max_len:
            raise BadRequest(
                f"sequence {i} has {len(seq)} tokens; the engine takes at most {max_len - 1} (serve.max_model_len="
                f"{max_len} holds the sequence and one generated token): cut the sequence, or raise "
                "serve.max_model_len above data.max_length"
            )
        for j, token in enumerate(seq):
            if type(token) is not int:  # bool and float are refused too
                raise BadRequest(f"sequence {i} token {j} must be an int, got {type(token).__name__}")
            if not 0 <= token < vocab_size:
                raise BadRequest(f"sequence {i} token {j} = {token} is outside the vocabulary [0, {vocab_size})")
        total += len(seq)
    if total > max_tokens:
        raise BadRequest(f"{total} tokens in one request; at most {max_tokens}, split the request")
    return batch
