"""Data-stage throughput against the raw tokenizer, measured side by side in one run.

    python bench/data_throughput.py --samples 200000

1. writes a slice of the synthetic reference corpus;
2. runs the whole data stage (Ray Data, local cluster) with 1 actor on 1 CPU,
   then 2 actors on 2 CPUs, timing each end to end (actor start-up included);
3. runs the same stage code in this process without Ray (read, prepare, write
   every shard, one thread) to separate Ray's overhead from the stage's own;
4. renders the same rows with the same template (untimed) and times the raw
   tokenizer on exactly those texts, on one thread: the Rust backend's batch
   call (the floor any stage pays) and the transformers tokenizer's batch call
   (what a hand-written script would use);
5. prints tokens/s per CPU and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # the baseline tokenizes on one core, like each actor

import ray  # noqa: E402

from raypipe.config import load_config  # noqa: E402
from raypipe.data.formats import Reject, normalize  # noqa: E402
from raypipe.data.pipeline import run_prepare  # noqa: E402
from raypipe.data.prepare import ShardPreparer  # noqa: E402
from raypipe.data.sources import plan_chunks, read_chunk  # noqa: E402
from raypipe.tools.corpus import CorpusSpec, write_corpus  # noqa: E402

OUT = Path(__file__).parent / "out"


def stage(corpus: Path, cpus: int, tag: str) -> tuple[float, dict]:
    output = OUT / f"prepared-{tag}"
    shutil.rmtree(output, ignore_errors=True)
    cfg = load_config(
        "debug_cpu",
        [
            f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]",
            f"data.output={output}",
            f"data.num_actors={cpus}",
            "data.cpus_per_actor=1",
            "data.chunk_bytes=8388608",
        ],
    ).data
    start = time.perf_counter()
    manifest = run_prepare(cfg)
    return time.perf_counter() - start, manifest["counts"]


def in_process(corpus: Path) -> tuple[float, int]:
    """The stage's work on one thread with no Ray: plan, prepare and write every shard."""
    from raypipe.data.output import PreparedOutput
    from raypipe.data.tokenizer import resolve_tokenizer

    output = OUT / "prepared-inprocess"
    shutil.rmtree(output, ignore_errors=True)
    cfg = load_config(
        "debug_cpu",
        [f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]", f"data.output={output}", "data.chunk_bytes=8388608"],
    ).data
    _, spec = resolve_tokenizer(cfg)
    start = time.perf_counter()
    preparer, out, tokens = ShardPreparer(cfg, spec), PreparedOutput(cfg.output, {}), 0
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        tokens += out.write_shard(preparer.prepare(chunk))["tokens_tokenized"]
    return time.perf_counter() - start, tokens


def rendered_texts(corpus: Path) -> tuple[list[str], object, object]:
    """The texts the stage tokenizes: every row's pieces joined, rendered by the stage's own renderer."""
    from raypipe.data.tokenizer import resolve_tokenizer

    cfg = load_config("debug_cpu", [f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]"]).data
    tok, spec = resolve_tokenizer(cfg)
    preparer = ShardPreparer(cfg, spec)
    texts = []
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        for _, raw in read_chunk(chunk, {}, cfg.max_row_bytes):
            try:
                segs = preparer.renderer.segment(normalize(json.loads(raw)))
            except Reject:
                continue
            texts.extend("".join(t for t, _ in s.pieces) for s in segs)
    return texts, preparer.backend, tok


def time_tokenizer(encode, texts: list[str], batch: int) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += encode(texts[i : i + batch])
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000)
    args = parser.parse_args()
    corpus = OUT / f"corpus-{args.samples}"
    write_corpus(corpus, CorpusSpec(num_samples=args.samples))

    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    t1, c1 = stage(corpus, 1, "1cpu")
    t2, c2 = stage(corpus, 2, "2cpu")
    ray.shutdown()
    assert c1 == c2

    ti, ni = in_process(corpus)
    texts, backend, tok = rendered_texts(corpus)
    tb, nb = time_tokenizer(
        lambda b: sum(len(e.ids) for e in backend.encode_batch_fast(b, add_special_tokens=False)), texts, 1024
    )
    th, nh = time_tokenizer(lambda b: sum(map(len, tok(b, add_special_tokens=False)["input_ids"])), texts, 1024)
    assert nb == nh == ni == c1["tokens_tokenized"], (nb, nh, ni, c1["tokens_tokenized"])

    n = c1["tokens_tokenized"]
    s1, s2 = n / t1, n / t2 / 2
    report = {
        "samples": args.samples,
        "rows_in": c1["rows_in"],
        "tokens_tokenized": n,
        "stage_1cpu_tokens_per_s_per_cpu": round(s1),
        "stage_2cpu_tokens_per_s_per_cpu": round(s2),
        "stage_code_without_ray_tokens_per_s": round(ni / ti),
        "raw_backend_tokens_per_s": round(nb / tb),
        "raw_transformers_tokens_per_s": round(nh / th),
        "ratio_1cpu_vs_backend": round(s1 / (nb / tb), 3),
        "ratio_1cpu_vs_transformers": round(s1 / (nh / th), 3),
        "ratio_2cpu_vs_backend": round(s2 / (nb / tb), 3),
        "ratio_without_ray_vs_backend": round(ni / ti / (nb / tb), 3),
        "scaling_2cpu_over_1cpu": round(t1 / t2, 3),
        "wall_s": {
            "stage_1cpu": round(t1, 1),
            "stage_2cpu": round(t2, 1),
            "without_ray": round(ti, 1),
            "backend": round(tb, 1),
            "transformers": round(th, 1),
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
