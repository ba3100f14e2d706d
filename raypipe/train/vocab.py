"""The drafter's reduced vocabulary (`train.drafter.draft_vocab_size`): the most frequent supervised tokens of the run.

A full-vocabulary drafter computes 151,936 (Qwen3) or 248,320 (Qwen3.6)
logits per draft position: the largest single cost of its step. With
`train.drafter.draft_vocab_size` the drafter's LM head keeps only the rows of the
tokens it is trained to predict most often: the supervised tokens of the
prepared data, on-policy replies in place of the placeholders, counted once
before the workers start. Ties go to the lower id and a vocabulary with fewer
distinct tokens is filled with the lowest unused ids (speculators'
`build_vocab_mappings_from_distribution`, so the mapping is the one its own
trainer would make).

The mapping is speculators' and vLLM's: `t2d`, a bool over the target's
vocabulary (True for the kept tokens), and `d2t`, an offset per draft id
(target id = draft id + d2t[draft id]). Both travel in the drafter's weights;
vLLM maps the draft logits back to target ids with them, so decoding stays
lossless: a token outside the draft vocabulary is never drafted, only
produced by the target. The run keeps the mapping under `vocab/{name}/` with the
digest of the data it counted, so resumed workers and the evaluation use the
same one (a run on other data counts anew; its checkpoints are refused by
raypipe.train.launcher.check_resume).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from raypipe.config import RaypipeConfig
from raypipe.console import logger
from raypipe.layout import RunFolders
from raypipe.train.rows import PreparedRows


@dataclass(frozen=True)
class DraftVocab:
    t2d: torch.Tensor  # bool [target vocabulary]
    d2t: torch.Tensor  # int64 [draft vocabulary]: target id - draft id

    @property
    def size(self) -> int:
        return int(self.d2t.numel())


def supervised_counts(rows: PreparedRows, vocab_size: int, chunk_rows: int = 4096) -> np.ndarray:
    """How often each target token is a supervised (loss-masked) token of the rows as trained, replies included;
    counted `chunk_rows` rows at a time (one vocabulary-sized count per chunk, not per row)."""
    counts = np.zeros(vocab_size, np.int64)
    for lo in range(0, len(rows), chunk_rows):
        chunk = [rows.row(i) for i in range(lo, min(lo + chunk_rows, len(rows)))]
        ids = np.concatenate([r.input_ids[r.loss_mask.astype(bool)] for r in chunk])
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def vocab_from_counts(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent tokens, as speculators' trainer maps them."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(
            f"train.drafter.draft_vocab_size={draft_vocab_size} must be in [1, {len(counts)}] (the target's vocabulary)"
        )
    frequencies = {int(t): int(counts[t]) for t in np.flatnonzero(counts)}
    d2t, t2d = build_vocab_mappings_from_distribution(frequencies, draft_vocab_size, len(counts))
    return DraftVocab(t2d=t2d, d2t=d2t)


def prepare_draft_vocab(cfg: RaypipeConfig, rows: PreparedRows, vocab_size: int) -> DraftVocab | None:
    """The run's mapping over `rows` (raypipe.train.replies.open_rows), counted once before the workers start and
    kept for the run: resumed workers and the evaluation must use the one its checkpoints were trained with. None
    with the full vocabulary."""
    if not uses_draft_vocab(cfg, vocab_size):
        return None
    stored = _read(cfg)
    if stored is not None and stored[1] == rows.manifest_sha256:
        return stored[0]
    rows.load_replies()
    counts = supervised_counts(rows, vocab_size)
    vocab = vocab_from_counts(counts, cfg.train.drafter.draft_vocab_size)
    buf = io.BytesIO()
    np.savez(buf, t2d=vocab.t2d.numpy(), d2t=vocab.d2t.numpy(), manifest_sha256=np.asarray(rows.manifest_sha256))
    RunFolders.of(cfg).vocab.write(_file(cfg), buf.getvalue())
    share = counts[vocab.t2d.numpy()].sum() / max(counts.sum(), 1)
    logger("train").info(
        f"draft vocabulary: {vocab.size:,} of {vocab_size:,} tokens, covering {share:.1%} of the supervised tokens"
    )
    return vocab


def uses_draft_vocab(cfg: RaypipeConfig, vocab_size: int) -> bool:
    return cfg.train.drafter.draft_vocab_size is not None and cfg.train.drafter.draft_vocab_size != vocab_size


def _file(cfg: RaypipeConfig) -> str:
    return f"draft_vocab_{cfg.train.drafter.draft_vocab_size}.npz"  # runs of other sizes may share train.output


def _read(cfg: RaypipeConfig) -> tuple[DraftVocab, str] | None:
    folder = RunFolders.of(cfg).vocab
    if not folder.exists(_file(cfg)):
        return None
    with np.load(io.BytesIO(folder.read(_file(cfg)))) as f:
        return DraftVocab(t2d=torch.from_numpy(f["t2d"]), d2t=torch.from_numpy(f["d2t"])), str(f["manifest_sha256"])


def read_draft_vocab(cfg: RaypipeConfig, vocab_size: int) -> DraftVocab | None:
    """The mapping `prepare_draft_vocab` stored for this run (workers, evaluation); None with the full vocabulary."""
    if not uses_draft_vocab(cfg, vocab_size):
        return None
    stored = _read(cfg)
    if stored is None:
        raise ValueError(
            f"{RunFolders.of(cfg).vocab.path(_file(cfg))} is missing: the training stage counts the draft vocabulary "
            "of train.drafter.draft_vocab_size (raypipe.train.vocab.prepare_draft_vocab); run it first"
        )
    return stored[0]
