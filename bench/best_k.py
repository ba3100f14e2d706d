"""The K to serve on the demo (issue 41, item 3): the evaluation's K sweep, TPOT per num_speculative_tokens K and
concurrency, and the K that export.json and the printed `vllm serve` command then use.

    python bench/best_k.py [key=value ...]    # overrides of the demo recipe, e.g. train.output=/tmp/bestk/demo/train

Runs `jobs/evaluate.py --recipe demo` (the whole evaluation: the K sweep at eval.k_concurrency, default [1, 16], with
the latency sweep at eval.concurrency, default [1, 4, 16], whose K = block − 1 rows it reuses) on an exported demo
drafter, then prints eval.json's `best_k` as a table and export.json's K and command. Records TPOT per K and level,
the best K per level and the K served.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from raypipe.config import load_config
    from raypipe.eval.best_k import format_table
    from raypipe.layout import RunFolders, eval_output

    overrides = sys.argv[1:]
    cfg = load_config("demo", overrides)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "jobs/evaluate.py", "--recipe", "demo", *overrides], cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"jobs/evaluate.py exited with {proc.returncode}")
    doc = eval_output(cfg).read_json("eval.json")
    export = RunFolders.of(cfg).export.read_json("export.json")
    best = doc["best_k"]
    print(f"\nTPOT per K (num_speculative_tokens) and concurrency, {doc['prompts']['count']} prompts:")
    print(format_table(best))
    print(
        f"\nbest K per level: {best['best_per_level']}; worst ratio to each level's best: {best['worst_ratio_to_best']}"
    )
    print(f"served: K={best['chosen']} ({best['rule']})")
    print(f"acceptance by position at T=0: {[round(r, 3) for r in doc['vllm'][0]['acceptance_per_position']]}")
    print(f"export.json: {json.dumps(export['speculative_config'])}")
    print(f"vllm_command: {export['vllm_command']}")
    print(json.dumps({"wall_s": round(wall), "best_k": best}, indent=1))
    figures = [
        figure(f"TPOT, K={k}, concurrency {level}", cell["tpot_ms"], "ms")
        for level, by_k in best["table"].items()
        for k, cell in by_k.items()
        if cell["tpot_ms"] is not None
    ]
    figures += [figure(f"best K, concurrency {level}", k) for level, k in best["best_per_level"].items()]
    figures += [
        figure("K served (export.json, vllm serve)", best["chosen"]),
        figure("served K's worst TPOT over a level's best", best["worst_ratio_to_best"][str(best["chosen"])], "x"),
        figure("whole evaluation, K sweep included", round(wall), "s"),
    ]
    record("best_k", figures)


if __name__ == "__main__":
    main()
