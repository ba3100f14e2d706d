"""Writing the corpus: each shard a pure function of (spec, format, shard index), then the manifest."""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.corpus.generate import _BUILDERS, _Gen
from bench.corpus.plan import _MANIFEST, CATEGORIES, CorpusSpec, Shard, category_counts, plan_shards
from raypipe.data.formats import FORMATS


def _content_chars(row: dict[str, Any]) -> int:
    """Characters of text a chat template would render (contents, reasoning, call arguments)."""
    if "messages" in row:
        total = 0
        for m in row["messages"]:
            total += len(m["content"]) + len(m.get("reasoning_content", ""))
            for call in m.get("tool_calls", ()):
                args = call["function"]["arguments"]
                total += len(args) if isinstance(args, str) else len(json.dumps(args))
        return total
    if "conversations" in row:
        return sum(len(t["value"]) for t in row["conversations"])
    return len(row["instruction"]) + len(row.get("input", "")) + len(row.get("output", ""))


# ---------------------------------------------------------------------------------------
# Writing: atomic files, a manifest updated after each file, skip what is complete.


def write_shard(output_dir: str | Path, spec: CorpusSpec, shard: Shard) -> dict[str, Any]:
    """Writes one file (temp name, then rename) and returns its stats for the manifest.

    The Random is seeded from (seed, format, index) alone and the category counts come from
    the plan, so any file can be made on its own, in any process, with the same bytes.
    """
    rng = random.Random(f"raypipe-corpus/{spec.seed}/{shard.fmt}/{shard.index}")
    gen = _Gen(rng)
    order = [c for c in CATEGORIES for _ in range(shard.counts.get(c, 0))]
    rng.shuffle(order)
    stats = {c: {"rows": 0, "content_chars": 0} for c in CATEGORIES if c in shard.counts}
    path = Path(output_dir) / shard.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    prefix = f"ref{spec.seed}-{shard.fmt}-{shard.index:05d}-"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        for j, category in enumerate(order):
            row = _BUILDERS[shard.fmt, category](gen)
            if shard.fmt != "alpaca" or rng.random() < 0.5:
                row = {"id": f"{prefix}{j:06d}", **row}
            f.write(json.dumps(row))
            f.write("\n")
            stats[category]["rows"] += 1
            stats[category]["content_chars"] += _content_chars(row)
    os.replace(tmp, path)
    return {
        "rows": len(order),
        "bytes": path.stat().st_size,
        "content_chars": sum(s["content_chars"] for s in stats.values()),
        "categories": stats,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="ascii")
    os.replace(tmp, path)


def _summary(spec: CorpusSpec, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per category and per format and character totals, from per-file stats."""
    categories = {c: {"rows": 0, "content_chars": 0} for c in CATEGORIES}
    formats: dict[str, dict[str, Any]] = {
        f: {"rows": 0, "files": 0, "bytes": 0, "content_chars": 0, "categories": {}} for f in FORMATS
    }
    for relpath, stats in files.items():
        fmt = formats[relpath.split("/")[0]]
        fmt["files"] += 1
        for key in ("rows", "bytes", "content_chars"):
            fmt[key] += stats[key]
        for c, s in stats["categories"].items():
            fmt["categories"][c] = fmt["categories"].get(c, 0) + s["rows"]
            categories[c]["rows"] += s["rows"]
            categories[c]["content_chars"] += s["content_chars"]
    total = {k: sum(f[k] for f in formats.values()) for k in ("rows", "files", "bytes", "content_chars")}
    return {
        "spec": asdict(spec),
        "counts": {c: s["rows"] for c, s in categories.items()},
        "categories": categories,
        "formats": formats,
        "total": total,
    }


REFERENCE = CorpusSpec()


def write_corpus(output_dir: str | Path, spec: CorpusSpec = REFERENCE) -> dict[str, int]:
    """Writes <output_dir>/{openai,sharegpt,alpaca}/part-NNNNN.jsonl and <output_dir>/corpus.json.

    Prompt-only rows live in the format folders, mixed with the others of that format.
    Each file is written atomically and recorded in corpus.json at once, so a re-run with
    the same spec skips recorded files whose size matches and rewrites the rest (same bytes).
    Returns the row count per category.
    """
    out = Path(output_dir)
    manifest_path = out / _MANIFEST
    files: dict[str, dict[str, Any]] = {}
    if manifest_path.exists():
        previous = json.loads(manifest_path.read_text())
        if previous["spec"] != asdict(spec):
            raise ValueError(
                f"{out} holds a corpus of spec {previous['spec']}, not {asdict(spec)}; "
                "delete it or use an empty output_dir"
            )
        files = previous["files"]
    out.mkdir(parents=True, exist_ok=True)
    for shard in plan_shards(spec):
        path, recorded = out / shard.relpath, files.get(shard.relpath)
        if recorded is None or not path.exists() or path.stat().st_size != recorded["bytes"]:
            files[shard.relpath] = write_shard(out, spec, shard)
            _write_json(manifest_path, {"spec": asdict(spec), "complete": False, "files": files})
    summary = _summary(spec, files)
    planned = dict.fromkeys(CATEGORIES, 0) | category_counts(spec.num_samples, spec.mix)
    assert summary["counts"] == planned, "written rows differ from the plan"
    _write_json(manifest_path, {**summary, "complete": True, "files": files})
    counts: dict[str, int] = summary["counts"]
    return counts
