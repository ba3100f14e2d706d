"""The reply pass against ray.data.llm and against vLLM's own offline generation, same prompts, same sampling.

    python bench/replies.py --rows 1000 --repeats 4

The demo target (builtin:demo) and the first --rows prompts of the bundled
demo data (prompt-only: every row needs a reply), prepared by the data stage.
1. the reply pass (raypipe.train.replies.run_replies): one engine as a Ray
   actor, shards generated with continuous batching and written as Parquet;
2. ray.data.llm (Ray's batch-inference processor over vLLM's asynchronous
   engine) generating the same prompts, with the same engine arguments,
   the same process options (CPUs, GPUs, serve.resource, ENGINE_ENV) and
   SamplingParams, in batches of `train.run.reply_max_sequences` rows (one
   engine, its 8 concurrent batches queued in it);
3. in this process, `vllm.LLM` with the same engine arguments generating the
   same prompts with the same SamplingParams in one call.
1 and 2 run --repeats times each, alternating which goes first (the machine
is shared: a pair measured back to back sees about the same load), each with
a new engine. Tokens per second of generation leave the engine's start out:
the pass reports its shards' generating and writing time; ray.data.llm's is
from its first request's arrival in the engine to the last reply in this
process (and, beside it, the engine core's own span: first request queued to
last token). Prints each pair's ratio (ray.data.llm / reply pass; the bar for
switching is >= 0.95 with identical replies) and the pass against vLLM's plain
`generate` (target >= 0.9); replies are greedy, so all three must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
OUT = Path(__file__).parent / "out" / "replies_bench"
DEMO = Path(__file__).resolve().parents[1] / "data" / "demo" / "train.jsonl"


def ray_data_llm(
    cfg: Any, engine: dict[str, Any], prompts: list[list[int]], sampling: dict[str, Any]
) -> dict[str, Any]:
    """The prompts through ray.data.llm's vLLM processor on the reply pass's engine and process options, with the
    settings that kept its engine fed on 2 cores (Ray's defaults measured worse, see BENCHMARKS.md)."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from raypipe.serve.deployment import engine_process_options

    batch = cfg.train.run.reply_max_sequences
    options = engine_process_options(cfg.serve)
    bundle = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options.get("resources", {})}
    kwargs = dict(engine)
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=kwargs.pop("model"),
            engine_kwargs=kwargs,
            runtime_env=options["runtime_env"],
            # without bundles its one-process engine asks Ray for tp * pp GPUs, and waits forever on a CPU node
            placement_group_config={"bundles": [{k: v for k, v in bundle.items() if v}]},
            concurrency=1,
            batch_size=batch,
            # every row of the actor's 8 concurrent batches queued in the engine, as vllm.LLM queues a whole shard
            # (the default, 1.1 x max_num_seqs, refills only through the front end; -1, "no limit", raises
            # AttributeError: asyncio has no NullContext, in Ray 2.60)
            max_pending_requests=8 * batch,
            chat_template_stage=False,
            tokenize_stage=False,
            detokenize_stage=False,
            log_engine_metrics=False,
        ),
        preprocess=lambda row: {"tokenized_prompt": row["ids"], "sampling_params": sampling},
        postprocess=lambda row: {
            "index": row["index"],
            "reply": row["generated_tokens"],
            "arrival": row["metrics"]["arrival_time"],  # wall clock, in the engine's front end
            "queued": row["metrics"]["queued_ts"],  # monotonic, in the engine core
            "last": row["metrics"]["last_token_ts"],
        },
        # at Ray Data's 1 CPU per map task, the rows reached the engine one batch at a time on 2 CPUs
        preprocess_map_kwargs={"num_cpus": 0.1},
        postprocess_map_kwargs={"num_cpus": 0.1},
    )
    items = [{"index": i, "ids": p} for i, p in enumerate(prompts)]
    start = time.perf_counter()
    out = processor(ray.data.from_items(items, override_num_blocks=-(-len(items) // batch))).to_pandas()
    done, wall = time.time(), time.perf_counter() - start
    out = out.sort_values("index")
    replies = [list(map(int, r)) for r in out["reply"]]
    return {
        "replies": replies,
        "tokens": sum(map(len, replies)),
        "generating_s": done - float(out["arrival"].min()),
        "engine_s": float(out["last"].max() - out["queued"].min()),
        "seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    import ray
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

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
    engine = {**engine_args(resolve_target(cfg.serve), cfg.serve), "max_num_seqs": cfg.train.run.reply_max_sequences}
    # vLLM's default chunk differs by entry point (CPU: 4096 for vllm.LLM, 2048 for the asynchronous engine that
    # ray.data.llm runs): both engines get the one the pass's vllm.LLM resolves
    resolved = EngineArgs(**engine).create_engine_config(UsageContext.LLM_CLASS)
    engine["max_num_batched_tokens"] = resolved.scheduler_config.max_num_batched_tokens

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    run_prepare(cfg.data)
    rows = open_rows(cfg)
    positions = [rows.prompts_of(s) for s in range(len(rows.shard_files))]
    prompts = [p for _, shard_prompts in positions for p in shard_prompts]
    sampling = reply_sampling(cfg, rows.end_of_turn_id)

    def reply_pass() -> dict[str, Any]:
        shutil.rmtree(OUT / "train" / "replies", ignore_errors=True)  # the pass generates every reply again
        passed = run_replies(cfg)
        stored = open_rows(cfg)
        stored.load_replies()
        passed["replies"] = [
            stored.row(int(stored.offsets[s]) + p).input_ids[len(q) :].tolist()
            for s, (shard_positions, shard_prompts) in enumerate(positions)
            for p, q in zip(shard_positions, shard_prompts)
        ]
        return passed

    def kept(replies: list[list[int]]) -> list[list[int]]:
        return [
            r[: cfg.data.max_length - len(q)] for r, q in zip(replies, prompts, strict=True)
        ]  # rows keep max_length

    pairs = []
    for repeat in range(args.repeats):
        arms = {"pass": reply_pass, "ray_data_llm": lambda: ray_data_llm(cfg, engine, prompts, sampling)}
        order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
        got = {name: arms[name]() for name in order}
        passed, processed = got["pass"], got["ray_data_llm"]
        pass_rate = passed["tokens"] / passed["generating_s"]
        pairs.append(
            {
                "first": order[0],
                "reply_pass_tokens_per_s": round(pass_rate, 1),
                "ray_data_llm_tokens_per_s": round(processed["tokens"] / processed["generating_s"], 1),
                "ray_data_llm_engine_tokens_per_s": round(processed["tokens"] / processed["engine_s"], 1),
                "ratio": round(processed["tokens"] / processed["generating_s"] / pass_rate, 3),
                "reply_pass_wall_s_with_engine_start": round(passed["seconds"], 1),
                "ray_data_llm_wall_s_with_engine_start": round(processed["seconds"], 1),
                "replies_differing": sum(a != b for a, b in zip(kept(processed["replies"]), passed["replies"])),
                "tokens": [passed["tokens"], processed["tokens"]],
                "load_average_1min": os.getloadavg()[0],
            }
        )
        print(json.dumps(pairs[-1]), flush=True)
    ray.shutdown()

    from vllm import LLM, SamplingParams

    llm = LLM(**engine)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling), use_tqdm=False)
    plain_s = time.perf_counter() - start
    plain = [list(o.outputs[0].token_ids) for o in outputs]
    report = {
        "prompts": len(prompts),
        "shards": len(positions),
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "pairs": pairs,
        "ray_data_llm_ratio_median": statistics.median(p["ratio"] for p in pairs),
        "ray_data_llm_replies_differing": sum(p["replies_differing"] for p in pairs),
        "vllm_offline_tokens_per_s": round(sum(map(len, plain)) / plain_s, 1),
        "reply_pass_to_vllm_offline": round(pairs[-1]["reply_pass_tokens_per_s"] / (sum(map(len, plain)) / plain_s), 3),
        "vllm_offline_replies_identical": kept(plain) == passed["replies"],
    }
    print(json.dumps(report, indent=1))
    record(
        "replies",
        [
            figure(
                "ray.data.llm over the reply pass, tokens/s (median of pairs)",
                report["ray_data_llm_ratio_median"],
                "x",
                at_least=0.95,
            ),
            figure("replies differing, ray.data.llm / reply pass", report["ray_data_llm_replies_differing"], ""),
            figure(
                "reply pass over vLLM's offline generate, tokens/s",
                report["reply_pass_to_vllm_offline"],
                "x",
                at_least=0.9,
            ),
            figure("reply pass (last pair)", pairs[-1]["reply_pass_tokens_per_s"], "tokens/s"),
            figure("vLLM's offline generate", report["vllm_offline_tokens_per_s"], "tokens/s"),
        ],
    )


if __name__ == "__main__":
    main()
