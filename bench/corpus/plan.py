"""What the synthetic corpus holds: its categories and formats at every scale, and its shards."""

from __future__ import annotations

from dataclasses import dataclass

from raypipe.data.formats import FORMATS

REFERENCE_SAMPLES = 913_786

CATEGORIES = ("prompt_only", "multi_turn", "tool_calling", "agentic_coding", "alpaca")

# Full-scale counts of everything but prompt-only; prompt-only takes the rest (800,000).
_BASE_COUNTS = {"multi_turn": 32_000, "tool_calling": 22_000, "agentic_coding": 1_286, "alpaca": 58_500}
# The mixes: the reference corpus, and its conversations alone (multi-turn chats, tool use and agentic coding traces,
# with system prompts, reasoning and replies of hundreds of tokens, in their reference proportions): the harder load.
MIXES = ("reference", "multi_turn")
# How each category is split over the formats, in integer parts (exact, no float rounding).
_FORMAT_PARTS = {
    "prompt_only": {"openai": 5, "sharegpt": 3, "alpaca": 2},
    "multi_turn": {"openai": 3, "sharegpt": 2},
    "tool_calling": {"openai": 4, "sharegpt": 1},
    "agentic_coding": {"openai": 1},
    "alpaca": {"alpaca": 1},
}
_CHARS_PER_TOKEN = 4  # English-like text with Qwen's BPE; lengths below are in tokens.
_MANIFEST = "corpus.json"


@dataclass(frozen=True)
class CorpusSpec:
    """What to generate; the corpus is a pure function of this."""

    num_samples: int = REFERENCE_SAMPLES
    seed: int = 0
    rows_per_file: int = 50_000
    mix: str = "reference"  # one of MIXES

    def __post_init__(self) -> None:
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"CorpusSpec.num_samples must be an int >= 1, got {self.num_samples!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"CorpusSpec.seed must be an int, got {self.seed!r}")
        if not isinstance(self.rows_per_file, int) or self.rows_per_file < 1:
            raise ValueError(f"CorpusSpec.rows_per_file must be an int >= 1, got {self.rows_per_file!r}")
        if self.mix not in MIXES:
            raise ValueError(f"CorpusSpec.mix must be one of {', '.join(MIXES)}, got {self.mix!r}")


@dataclass(frozen=True)
class Shard:
    """One output file: its format, index and how many rows of each category it holds."""

    fmt: str
    index: int
    counts: dict[str, int]

    @property
    def relpath(self) -> str:
        return f"{self.fmt}/part-{self.index:05d}.jsonl"


# ---------------------------------------------------------------------------------------
# Planning: exact integer counts, so totals always add up at any scale.


def category_counts(num_samples: int, mix: str = "reference") -> dict[str, int]:
    """Scales the mix to num_samples; the rounding remainder goes to prompt-only (reference) or multi-turn chats."""
    if mix == "multi_turn":
        base = {c: _BASE_COUNTS[c] for c in ("tool_calling", "agentic_coding")}
        total = _BASE_COUNTS["multi_turn"] + sum(base.values())
        scaled = {c: n * num_samples // total for c, n in base.items()}
        return {"multi_turn": num_samples - sum(scaled.values()), **scaled}
    scaled = {c: n * num_samples // REFERENCE_SAMPLES for c, n in _BASE_COUNTS.items()}
    return {"prompt_only": num_samples - sum(scaled.values()), **scaled}


def format_counts(num_samples: int, mix: str = "reference") -> dict[str, dict[str, int]]:
    """Rows per format and category; the last format of a category takes its remainder."""
    out: dict[str, dict[str, int]] = {f: {} for f in FORMATS}
    for category, n in category_counts(num_samples, mix).items():
        parts = _FORMAT_PARTS[category]
        total_parts, left = sum(parts.values()), n
        for i, (fmt, part) in enumerate(parts.items()):
            take = left if i == len(parts) - 1 else n * part // total_parts
            out[fmt][category], left = take, left - take
    return out


def plan_shards(spec: CorpusSpec) -> list[Shard]:
    """Spreads each format's categories evenly over its files (largest remainder per file).

    Apportioning what is left over what is left keeps every file's counts exact and
    non-negative, and makes every file a mix rather than blocks of one category.
    """
    shards = []
    for fmt, counts in format_counts(spec.num_samples, spec.mix).items():
        remaining = {c: n for c, n in counts.items() if n}
        rows_left, index = sum(remaining.values()), 0
        while rows_left:
            size = min(spec.rows_per_file, rows_left)
            take = {c: size * n // rows_left for c, n in remaining.items()}
            by_fraction = sorted(remaining, key=lambda c: -(size * remaining[c] % rows_left))
            for c in by_fraction[: size - sum(take.values())]:
                take[c] += 1
            shards.append(Shard(fmt, index, {c: n for c, n in take.items() if n}))
            remaining = {c: n - take[c] for c, n in remaining.items()}
            rows_left, index = rows_left - size, index + 1
    return shards


# ---------------------------------------------------------------------------------------
# Text banks, built once from a fixed seed; rows then pick from them (fast, and text
# tokenizes like English prose, Python/JS code and logs).
