"""The reply pass against vLLM's own offline generation of the same prompts with the same sampling.

    python bench/replies.py --rows 1000

The demo target (builtin:demo) and the first --rows prompts of the bundled
demo data (prompt-only: every row needs a reply), prepared by the data stage.
1. the reply pass (raypipe.train.replies.run_replies): one engine as a Ray
   actor, shards generated with continuous batching and written as Parquet;
2. in this process, `vllm.LLM` with the same engine arguments generating the
   same prompts with the same SamplingParams in one call.
Both count tokens per second of generation (engine start-up left out: the
pass reports its generating time per shard, the plain run times its one
`generate` call). Prints both and the ratio (target >= 0.9), and checks the
replies are identical (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
OUT = Path(__file__).parent / "out" / "replies_bench"
DEMO = Path(__file__).resolve().parents[1] / "data" / "demo" / "train.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args()

    import ray

    from raypipe.config import load_config
    from raypipe.data.pipeline import run_prepare
    from raypipe.serve.vllm_args import engine_args
    from raypipe.target import resolve_target
    from raypipe.train.replies import open_rows, reply_sampling, run_replies

    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "src").mkdir(parents=True)
    (OUT / "src" / "train.jsonl").write_text("\n".join(DEMO.read_text().splitlines()[: args.rows]) + "\n")
    cfg = load_config(
        "demo",
        [
            f"data.sources=[{{path: {OUT}/src/train.jsonl}}]",
            f"data.output={OUT}/prepared",
            f"train.output={OUT}/train",
            "train.run.reply_max_sequences=64",
        ],
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    run_prepare(cfg.data)
    passed = run_replies(cfg)
    ray.shutdown()

    from vllm import LLM, SamplingParams

    rows = open_rows(cfg)
    rows.load_replies()
    prompts, stored = [], []
    for shard in range(len(rows.shard_files)):
        positions, shard_prompts = rows.prompts_of(shard)
        prompts += shard_prompts
        stored += [
            rows.row(int(rows.offsets[shard]) + p).input_ids[len(q) :].tolist()
            for p, q in zip(positions, shard_prompts)
        ]
    llm = LLM(
        **{**engine_args(resolve_target(cfg.serve), cfg.serve), "max_num_seqs": cfg.train.run.reply_max_sequences}
    )
    params = SamplingParams(**reply_sampling(cfg, rows.end_of_turn_id))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain_s = time.perf_counter() - start
    plain = [list(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(map(len, plain))
    report = {
        "prompts": len(prompts),
        "shards": passed["shards"],
        "reply_tokens": passed["tokens"],
        "reply_pass_tokens_per_s": round(passed["tokens"] / passed["generating_s"], 1),
        "reply_pass_wall_s_with_engine_start": round(passed["seconds"], 1),
        "vllm_offline_tokens_per_s": round(tokens / plain_s, 1),
        "ratio": round((passed["tokens"] / passed["generating_s"]) / (tokens / plain_s), 3),
        "replies_identical": [r[: cfg.data.max_length - len(q)] for r, q in zip(plain, prompts)]
        == stored,  # rows keep max_length tokens
    }
    print(json.dumps(report, indent=1))
    record(
        "replies",
        [
            figure("reply pass over vLLM's offline generate, tokens/s", report["ratio"], "x", at_least=0.9),
            figure("reply pass", report["reply_pass_tokens_per_s"], "tokens/s"),
            figure("vLLM's offline generate", report["vllm_offline_tokens_per_s"], "tokens/s"),
        ],
    )


if __name__ == "__main__":
    main()
