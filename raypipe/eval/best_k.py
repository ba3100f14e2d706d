"""The K to serve: the drafter's time per output token at each `num_speculative_tokens` K = 1..block − 1, per load.

Acceptance falls with the draft position (0.93, 0.83, 0.76 on the demo), and each drafted token costs the drafter a
step and the target a verified position, so the K with the lowest TPOT may be below block − 1, and it depends on the
load: at high concurrency the target's verification of K + 1 positions per sequence is no longer free.

The evaluation measures each K at the `eval.k_concurrency` levels through vLLM's OpenAI server
(raypipe.eval.latency; the rows of K = block − 1 come from the latency sweep where the levels coincide), and this
module, pure, turns the rows into:
- the table: {level: {K: {tpot_ms, tokens_per_s, tau}}} (TPOT the mean over the level's requests; None where every
  reply was a single token, so no TPOT was measured);
- the best K per level: the lowest mean TPOT; a tie goes to the smaller K (fewer drafted tokens to throw away for the
  same latency); a K without a TPOT at a level is no candidate there; a level where no K has one has no best (None);
- the served K: the one whose worst ratio of its TPOT to each level's best TPOT is the lowest (the least it can lose
  at any measured load; where the levels agree, their common best, ratio 1); ties to the smaller K. Only the K
  measured at every level that has a best are candidates. With no candidate (no TPOT measured) none is chosen, and
  the export keeps K = block − 1 (the evaluation says so).

`write_served_k` rewrites the export's `export.json` with the chosen K (`speculative_config.num_speculative_tokens`,
`vllm_command`), recording which measurement chose it (`num_speculative_tokens_chosen_by`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raypipe.storage import Storage

RULE = (
    "per level the lowest mean TPOT (ties: the smaller K); served: the lowest worst-case ratio of its TPOT to each "
    "level's best (ties: the smaller K)"
)


def k_table(rows: list[dict[str, Any]]) -> dict[int, dict[int, dict[str, float | None]]]:
    """{level: {K: {tpot_ms, tokens_per_s, tau}}} from the sweep's rows (raypipe.eval.latency.sweep's, each with its
    `num_speculative_tokens`), levels and K in ascending order."""
    table: dict[int, dict[int, dict[str, float | None]]] = {}
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["num_speculative_tokens"])):
        k, level = r["num_speculative_tokens"], r["concurrency"]
        assert k not in table.get(level, {}), f"K={k} measured twice at concurrency {level}"
        table.setdefault(level, {})[k] = {
            "tpot_ms": r["tpot_ms"]["mean"] if r["tpot_ms"] else None,
            "tokens_per_s": r["tokens_per_s"],
            "tau": r["tau"],
        }
    return table


def _tpots(by_k: dict[int, dict[str, float | None]]) -> dict[int, float]:
    return {k: cell["tpot_ms"] for k, cell in by_k.items() if cell["tpot_ms"] is not None}


def best_per_level(table: dict[int, dict[int, dict[str, float | None]]]) -> dict[int, int | None]:
    """Each level's K with the lowest mean TPOT (ties: the smaller K); None where no K has a TPOT."""
    best = {}
    for level, by_k in table.items():
        tpots = _tpots(by_k)
        best[level] = min(tpots, key=lambda k: (tpots[k], k)) if tpots else None
    return best


def worst_ratios(table: dict[int, dict[int, dict[str, float | None]]]) -> dict[int, float]:
    """Per candidate K (measured at every level that has a best): its highest TPOT over the level's best TPOT."""
    levels = {level: _tpots(by_k) for level, by_k in table.items() if _tpots(by_k)}
    if not levels:
        return {}
    candidates = set.intersection(*(set(t) for t in levels.values()))
    return {k: max(t[k] / min(t.values()) for t in levels.values()) for k in sorted(candidates)}


def choose(table: dict[int, dict[int, dict[str, float | None]]]) -> int | None:
    """The served K: the lowest worst-case ratio to each level's best TPOT (ties: the smaller K); None without one."""
    ratios = worst_ratios(table)
    return min(ratios, key=lambda k: (ratios[k], k)) if ratios else None


def best_k_report(rows: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    """eval.json's `best_k` (JSON keys are strings: levels and K as text)."""
    table = k_table(rows)
    chosen = choose(table)
    return {
        "levels": list(table),
        "ks": list(range(1, block_size)),
        "table": {str(level): {str(k): cell for k, cell in by_k.items()} for level, by_k in table.items()},
        "best_per_level": {str(level): k for level, k in best_per_level(table).items()},
        "worst_ratio_to_best": {str(k): r for k, r in worst_ratios(table).items()},
        "chosen": chosen,
        "default": block_size - 1,
        "rule": RULE,
    }


def format_table(report: dict[str, Any]) -> str:
    """The table as Markdown: a row per K, TPOT / tokens/s / τ per level, the best per level and the chosen K marked."""
    levels = [str(level) for level in report["levels"]]
    head = "| K | " + " | ".join(f"concurrency {level}: TPOT ms, tokens/s, τ" for level in levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels)]
    for k in map(str, report["ks"]):
        cells = []
        for level in levels:
            cell = report["table"][level].get(k)
            if cell is None:
                cells.append("not measured")
                continue
            tpot = "—" if cell["tpot_ms"] is None else f"{cell['tpot_ms']:.2f}"
            tau = "—" if cell["tau"] is None else f"{cell['tau']:.2f}"
            best = " **best**" if str(report["best_per_level"][level]) == k else ""
            cells.append(f"{tpot}, {cell['tokens_per_s']:.0f}, {tau}{best}")
        served = " (served)" if str(report["chosen"]) == k else ""
        lines.append(f"| {k}{served} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_served_k(
    export: Storage, k: int, chosen_by: dict[str, Any], command: Callable[[dict[str, Any]], str]
) -> dict[str, Any]:
    """Rewrite `export.json` in `export` with `k` to serve: `speculative_config.num_speculative_tokens`, the
    `vllm_command` (`command(speculative_config)`, raypipe.serve.vllm_args.serve_command with the evaluation's engine
    options) and `num_speculative_tokens_chosen_by`. Written whole or not at all (Storage.write_json: a temporary
    name, then a rename), as the export writes it; returns the new document."""
    from raypipe.train.export import DONE

    doc = export.read_json(DONE)
    speculative = {**doc["speculative_config"], "num_speculative_tokens": k}
    doc.update(
        speculative_config=speculative, vllm_command=command(speculative), num_speculative_tokens_chosen_by=chosen_by
    )
    export.write_json(DONE, doc)
    return doc
