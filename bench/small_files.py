"""Many small input files against the same rows in one file, through the data stage under Ray, side by side in one run.

    python bench/small_files.py                                  # 10,000 files of 10 rows (100,000 rows), minutes
    python bench/small_files.py --files 1000 --rows-per-file 10  # quicker

Datasets often come as thousands of small files. The rows are the reference corpus's (bench.corpus: mostly
short prompts, about 440 bytes a row), in its order: cut into `--files` JSONL files of `--rows-per-file` rows, and
written again as one JSONL file. Both are prepared by the whole data stage under Ray Data (a local cluster of 2 CPUs,
2 actors of 1 CPU, the default shard size), timed end to end, after an untimed run on one small file that pays the
process's one-off costs (imports, the tokenizer's first build, Ray's first workers). Printed: shards made, rows/s for
each, and the ratio (small files against one file); the counts of the two runs must agree (asserted).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import ray
from figures import figure, record  # bench/ is on sys.path when this runs as a script

from bench.corpus import CorpusSpec, write_corpus
from raypipe.config import load_config
from raypipe.data.pipeline import run_prepare_timed

OUT = Path(__file__).parent / "out"


def write_inputs(files: int, rows_per_file: int) -> tuple[Path, Path, Path]:
    """(directory of `files` small files, directory of one file holding the same reference-corpus rows, directory of
    the first small file alone for the warm-up)."""
    corpus = OUT / f"corpus-reference-{files * rows_per_file}"
    write_corpus(corpus, CorpusSpec(num_samples=files * rows_per_file))
    lines = [line for part in sorted(corpus.glob("*/*.jsonl")) for line in part.read_bytes().splitlines(keepends=True)]
    small, one, warm = (OUT / f"{name}-{files}x{rows_per_file}" for name in ("small", "one", "warm-up"))
    for folder in (small, one, warm):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    for i in range(files):
        (small / f"part-{i:06d}.jsonl").write_bytes(b"".join(lines[i * rows_per_file : (i + 1) * rows_per_file]))
    (one / "all.jsonl").write_bytes(b"".join(lines))
    shutil.copy(small / "part-000000.jsonl", warm)
    return small, one, warm


def prepare(inputs: Path, tag: str) -> dict:
    """The whole data stage on `inputs` under Ray: shards made, rows/s, where the time went."""
    output = OUT / f"prepared-small-files-{tag}"
    shutil.rmtree(output, ignore_errors=True)
    overrides = [
        f"data.sources=[{{path: '{inputs}'}}]",
        f"data.output={output}",
        "data.chunk_bytes=16777216",  # the default (debug_cpu's small one is for tests)
        "data.num_actors=2",
        "data.cpus_per_actor=1",
    ]
    cfg = load_config("debug_cpu", overrides).data
    start = time.perf_counter()
    manifest, timing = run_prepare_timed(cfg)
    wall = time.perf_counter() - start
    c = manifest["counts"]
    return {
        "input_files": len(list(inputs.iterdir())),
        "shards": len(manifest["shards"]),
        "rows_in": c["rows_in"],
        "rows_kept": c["rows_kept"],
        "tokens": c["tokens"],
        "wall_s": round(wall, 1),
        "rows_per_s": round(c["rows_in"] / wall),
        "breakdown_s": {
            "dataset": round(timing["wall_s"], 1),
            "actors_own_work": round(timing["actor_s"], 1),
            "driver_before_and_after": round(wall - timing["wall_s"], 1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000, help="small files to write")
    parser.add_argument("--rows-per-file", type=int, default=10, help="rows in each small file")
    args = parser.parse_args()
    small, one, warm = write_inputs(args.files, args.rows_per_file)
    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    prepare(warm, "warm-up")
    report = {"small_files": prepare(small, "small"), "one_file": prepare(one, "one")}
    ray.shutdown()
    counts = ("rows_in", "rows_kept", "tokens")
    assert [report["small_files"][k] for k in counts] == [report["one_file"][k] for k in counts], report
    report["ratio_rows_per_s_small_vs_one"] = round(
        report["small_files"]["rows_per_s"] / report["one_file"]["rows_per_s"], 3
    )
    print(json.dumps(report, indent=1))
    record(
        "small_files",
        [
            figure(f"{args.files:,} small files over one file, rows/s", report["ratio_rows_per_s_small_vs_one"], "x"),
            figure(f"{args.files:,} small files", report["small_files"]["rows_per_s"], "rows/s"),
        ],
    )


if __name__ == "__main__":
    main()
