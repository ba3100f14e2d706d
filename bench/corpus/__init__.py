"""Synthetic reference corpus: the 913,786-sample chat mix the data stage is sized for (`python -m bench.corpus`).

Benchmarks and end-to-end tests need input shaped like the real mix (800K prompt-only
requests plus multi-turn chats, tool calls, long agentic coding traces and Alpaca rows)
in every input format, at full scale, with no download. Each shard is a pure function of
(spec, format, shard index): shards can be written independently, and re-runs are
byte-identical. Text is clean ASCII (bad inputs are tested elsewhere) built from
precomputed banks of English-like sentences, code and logs, so generation is fast.
It lives beside the benchmarks, its users (and the tests of the data stage's scale, and `data/sample/`'s source).
"""

from bench.corpus.plan import (
    CATEGORIES,
    MIXES,
    REFERENCE_SAMPLES,
    CorpusSpec,
    Shard,
    category_counts,
    format_counts,
    plan_shards,
)
from bench.corpus.write import write_corpus, write_shard

__all__ = [
    "CATEGORIES",
    "MIXES",
    "REFERENCE_SAMPLES",
    "CorpusSpec",
    "Shard",
    "category_counts",
    "format_counts",
    "plan_shards",
    "write_corpus",
    "write_shard",
]
