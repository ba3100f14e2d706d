"""The full 913,786-sample reference run: wall time and peak memory of the whole Ray job.

    python bench/full_corpus.py

Writes the synthetic reference corpus, then runs `jobs/prepare_data.py` (which
starts its own local Ray cluster) as a subprocess and samples, every
second, the proportional set size (PSS: shared pages such as the object store
split between the processes that map them) summed over the job's whole process
tree: driver, GCS, raylet, dashboard and every worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
from figures import figure, record  # bench/ is on sys.path when this runs as a script

from bench.corpus import REFERENCE_SAMPLES, CorpusSpec, write_corpus

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def tree_pss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=REFERENCE_SAMPLES)
    args = parser.parse_args()
    corpus, output = OUT / f"corpus-{args.samples}", OUT / f"prepared-{args.samples}"
    start = time.perf_counter()
    write_corpus(corpus, CorpusSpec(num_samples=args.samples))
    corpus_s = time.perf_counter() - start
    shutil.rmtree(output, ignore_errors=True)

    cmd = [
        sys.executable,
        "jobs/prepare_data.py",
        "--recipe",
        "debug_cpu",
        f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]",
        f"data.output={output}",
        "data.num_actors=2",
        "data.cpus_per_actor=1",
        "data.chunk_bytes=16777216",
    ]
    start = time.perf_counter()
    log = OUT / "full_corpus_job.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": "local"}
        )
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            peak = max(peak, tree_pss(ps))
            time.sleep(1.0)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"job failed ({proc.returncode}), see {log}")
    manifest = json.loads((output / "manifest.json").read_text())
    c = manifest["counts"]
    record(
        "full_corpus",
        [
            figure(f"job wall time ({args.samples:,} samples, 2 actors)", wall, "s"),
            figure("peak memory (PSS, whole job)", peak / 2**30, "GiB", at_most=5.58),  # the target: 6 GB
        ],
    )
    print(
        json.dumps(
            {
                "samples": args.samples,
                "corpus_write_s": round(corpus_s, 1),
                "job_wall_s": round(wall, 1),
                "peak_pss_gib": round(peak / 2**30, 2),
                "rows_in": c["rows_in"],
                "rows_kept": c["rows_kept"],
                "rows_rejected": c["rows_rejected"],
                "split_extra": c["split_extra"],
                "tokens_tokenized": c["tokens_tokenized"],
                "tokens_kept": c["tokens"],
                "tokens_per_s": round(c["tokens_tokenized"] / wall),
                "shards": len(manifest["shards"]),
                "rejects_by_code": manifest["rejects_by_code"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
