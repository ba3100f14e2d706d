"""Data-stage throughput against the raw tokenizer, measured side by side in one run, on two corpora.

    python bench/data_throughput.py                   # the whole project corpus (913,786 samples), about 8 min
    python bench/data_throughput.py --samples 100000  # quicker; the stage's fixed cost weighs more

The stage's fixed cost (the driver's tokenizer load, Ray Data's and the actors' start-up: about 4 s on 2 cores) does
not grow with the input: it is under 5% of the whole corpus's run and about a third of a 100,000-sample one.

For the project's reference corpus (mostly one-turn prompts) and its multi-turn mix (chats, tool use and agentic
traces with system prompts, reasoning and replies of hundreds of tokens), both from bench.corpus:
1. the whole data stage under Ray Data (a local cluster of 2 CPUs, 2 actors of 1 CPU), timed end to end (actor
   start-up included), with the stage's own account of the actors' work and of Ray Data around it;
2. the same stage code in this process without Ray (plan, prepare and write every shard, one thread);
3. the raw tokenizer on exactly the texts the stage tokenizes (rendered untimed by the stage's renderer), one
   thread, the Rust backend's batch call: the floor any data stage pays;
then tokens/s per CPU and the ratios. Every rate counts the same tokens (asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ["RAYON_NUM_THREADS"] = "1"  # the baseline tokenizes on one core, like each actor

import ray  # noqa: E402

from bench.corpus import REFERENCE_SAMPLES, CorpusSpec, write_corpus  # noqa: E402
from raypipe.config import load_config  # noqa: E402
from raypipe.data.formats import Reject, normalize  # noqa: E402
from raypipe.data.output import PreparedOutput  # noqa: E402
from raypipe.data.pipeline import run_prepare_timed  # noqa: E402
from raypipe.data.prepare import SCREEN_CHARS, ShardPreparer  # noqa: E402
from raypipe.data.sources import plan_chunks, read_chunk  # noqa: E402
from raypipe.data.tokenizer import resolve_tokenizer  # noqa: E402

OUT = Path(__file__).parent / "out"


def data_config(corpus: Path, output: Path, *overrides: str):
    """debug_cpu's data stage on `corpus`, with the default shard size (debug_cpu's small one is for tests)."""
    sources = f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]"
    return load_config("debug_cpu", [sources, f"data.output={output}", "data.chunk_bytes=16777216", *overrides]).data


def under_ray(corpus: Path, tag: str) -> tuple[float, dict, dict]:
    output = OUT / f"prepared-{tag}-ray"
    shutil.rmtree(output, ignore_errors=True)
    cfg = data_config(corpus, output, "data.num_actors=2", "data.cpus_per_actor=1")
    start = time.perf_counter()
    manifest, timing = run_prepare_timed(cfg)
    return time.perf_counter() - start, manifest["counts"], timing


def in_process(corpus: Path, tag: str) -> tuple[float, int]:
    """The stage's work on one thread with no Ray: plan, prepare and write every shard."""
    output = OUT / f"prepared-{tag}-inprocess"
    shutil.rmtree(output, ignore_errors=True)
    cfg = data_config(corpus, output)
    _, spec = resolve_tokenizer(cfg)
    start = time.perf_counter()
    preparer, out, tokens = ShardPreparer(cfg, spec), PreparedOutput(cfg.output, {}), 0
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        tokens += out.write_shard(preparer.prepare(chunk))["tokens_tokenized"]
    return time.perf_counter() - start, tokens


def raw_tokenizer(corpus: Path) -> tuple[float, int, str]:
    """The raw tokenizer's time and tokens on the texts the stage tokenizes, and the template engine's note."""
    cfg = data_config(corpus, OUT / "unused")
    _, spec = resolve_tokenizer(cfg)
    preparer = ShardPreparer(cfg, spec)
    texts = []
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        for _, raw in read_chunk(chunk, {}, cfg.max_row_bytes):
            try:
                segs = preparer.renderer.segment(normalize(json.loads(raw)))
            except Reject:
                continue
            if sum(len(t) for s in segs for t, _ in s.pieces) >= SCREEN_CHARS:  # as the stage screens large rows
                known: dict[str, int] = {}
                segs = [s for s in segs if s.turn is None or preparer.prompt_tokens(s, known) < cfg.max_length]
            texts.extend("".join(t for t, _ in s.pieces) for s in segs)
    backend, start, tokens = preparer.backend, time.perf_counter(), 0
    for i in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(texts[i : i + 1024], add_special_tokens=False))
    return time.perf_counter() - start, tokens, spec.template_engine_note


def measure(corpus: Path, tag: str) -> dict:
    t_ray, counts, timing = under_ray(corpus, tag)
    t_in, n_in = in_process(corpus, tag)
    t_raw, n_raw, engine = raw_tokenizer(corpus)
    n = counts["tokens_tokenized"]
    assert n == n_in == n_raw, (n, n_in, n_raw)
    raw = n / t_raw
    return {
        "rows_in": counts["rows_in"],
        "rows_kept": counts["rows_kept"],
        "tokens_tokenized": n,
        "template_engine": engine,
        "raw_tokenizer_tokens_per_s": round(raw),
        "without_ray_tokens_per_s": round(n / t_in),
        "ray_2_actors_tokens_per_s_per_cpu": round(n / t_ray / 2),
        "ratio_without_ray_vs_raw": round(n / t_in / raw, 3),
        "ratio_ray_per_cpu_vs_raw": round(n / t_ray / 2 / raw, 3),
        "ray_rows_per_s": round(counts["rows_in"] / t_ray),
        "wall_s": {"ray": round(t_ray, 1), "without_ray": round(t_in, 1), "raw_tokenizer": round(t_raw, 1)},
        "ray_breakdown_s": {
            "dataset": round(timing["wall_s"], 1),
            "actors_own_work": round(timing["actor_s"], 1),
            "driver_before_and_after": round(t_ray - timing["wall_s"], 1),
            "actor_utilization": round(timing["actor_s"] / (timing["actors"] * timing["wall_s"]), 3),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=REFERENCE_SAMPLES, help="rows of the reference corpus")
    parser.add_argument("--multi-turn-samples", type=int, default=8_000, help="rows of the multi-turn mix")
    args = parser.parse_args()
    corpora = {
        "reference": (args.samples, "reference"),
        "multi_turn": (args.multi_turn_samples, "multi_turn"),
    }
    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    report = {}
    for tag, (samples, mix) in corpora.items():
        corpus = OUT / f"corpus-{mix}-{samples}"
        write_corpus(corpus, CorpusSpec(num_samples=samples, mix=mix))
        report[tag] = {"samples": samples, **measure(corpus, tag)}
    ray.shutdown()
    print(json.dumps(report, indent=1))
    ref, multi = report["reference"], report["multi_turn"]
    record(
        "data_throughput",
        [
            figure(
                f"reference corpus ({args.samples:,}), in-process / raw tokenizer",
                ref["ratio_without_ray_vs_raw"],
                "x",
                at_least=0.9,
            ),
            figure("reference corpus, Ray per CPU / raw tokenizer", ref["ratio_ray_per_cpu_vs_raw"], "x", at_least=0.7),
            figure(
                f"multi-turn mix ({args.multi_turn_samples:,}), in-process / raw tokenizer",
                multi["ratio_without_ray_vs_raw"],
                "x",
                at_least=0.9,
            ),
            figure("multi-turn mix, Ray per CPU / raw tokenizer", multi["ratio_ray_per_cpu_vs_raw"], "x", at_least=0.7),
        ],
    )


if __name__ == "__main__":
    main()
