"""Peak memory of one shard preparer on two pathological rows, before and after issue 13, side by side in one run.

Cases (each in a fresh Python process, so nothing is shared or cached between them):
  64mib_line   one JSONL line of 64 MiB (over data.max_row_bytes, 8 MiB by default): rejected as oversized_row;
  60_turns     one 0.6 MB row of 60 user/assistant exchanges under qwen_strict, a history-rewriting template that
               forces one row per assistant turn; default data.max_length 3072.
The preparer is built first; then the kernel's RSS high-water mark is reset (`5` into /proc/self/clear_refs) and
`ShardPreparer.prepare` runs on the one chunk: the figure is VmHWM after minus VmRSS before, so setup is not counted
(freed heap is handed back with malloc_trim first, so the case cannot hide in memory the setup left resident).

"before" is the code at commit 28289d4, checked out read-only beside the repository (it does not touch the working
tree):
    git worktree add /tmp/before_13 28289d4
    .venv/bin/python bench/row_memory.py --before /tmp/before_13
    git worktree remove /tmp/before_13
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
CASES = ("64mib_line", "60_turns")


def write_case(case: str, path: Path) -> None:
    if case == "64mib_line":
        text = "z" * (64 << 20)
        path.write_text(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
        return
    rng = random.Random(0)
    # ~1 token per character, like the probe
    words = lambda n: " ".join(f"{rng.getrandbits(24):06x}" for _ in range(n))  # noqa: E731
    messages = []
    for _ in range(60):
        messages += [{"role": "user", "content": words(715)}, {"role": "assistant", "content": words(715)}]
    path.write_text(json.dumps({"id": "long", "messages": messages}) + "\n")


def _status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def measure(case: str) -> dict:
    """Run in the child: prepare the one chunk of the case and report its peak memory above the preparer's own."""
    import raypipe
    from raypipe.config import DataConfig
    from raypipe.data.prepare import ShardPreparer
    from raypipe.data.sources import plan_chunks
    from raypipe.data.tokenizer import resolve_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.jsonl"
        write_case(case, path)
        cfg = DataConfig.model_validate(
            {
                "sources": [{"path": str(path)}],
                "output": f"{tmp}/out",
                "tokenizer": "builtin:qwen",
                "chat_template": "qwen_strict",
            }
        )
        _, spec = resolve_tokenizer(cfg)
        preparer = ShardPreparer(cfg, spec)
        [chunk] = plan_chunks(cfg.sources, {}, 1 << 30)  # the whole file in one chunk, as one actor would see a line
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(
            0
        )  # return the setup's freed heap to the OS, or the case would reuse it unseen
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
        base = _status("VmRSS")
        start = time.perf_counter()
        result = preparer.prepare(chunk)
        seconds = time.perf_counter() - start
        peak = _status("VmHWM") - base
        raw_bytes = sum(len(json.dumps(r)) for r in result.rejects)
    s = result.stats
    return {
        "peak_mib": peak / 2**20,
        "seconds": seconds,
        "tokens_tokenized": s["tokens_tokenized"],
        "rows_kept": s["rows_kept"],
        "rows_rejected": s["rows_rejected"],
        "rejects_by_code": s["rejects_by_code"],
        "reject_record_bytes": raw_bytes,
        "code": str(Path(raypipe.__file__).parent),
    }


def run(case: str, code_root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root), "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", case], cwd=code_root, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{case} under {code_root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--before", type=Path, help="a checkout of the code before the fix (git worktree add /tmp/before_13 28289d4)"
    )
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    versions = ([("before", args.before)] if args.before else []) + [("after", ROOT)]
    print(
        f"{'case':<11} {'code':<7} {'peak MiB':>9} {'seconds':>8} {'tokens tokenized':>17} {'kept':>5} {'rejected':>8} "
        f"{'reject bytes':>13}  rejects by code"
    )
    figures = []
    for case in CASES:
        for name, root in versions:
            r = run(case, root)
            label = {"64mib_line": "64 MiB line", "60_turns": "60 turns"}[case]
            figures.append(
                figure(f"{label}, " + ("peak" if name == "after" else "before issue 13"), r["peak_mib"], "MiB")
            )
            assert r["code"] == str(root / "raypipe"), f"the {name} case ran {r['code']}, not {root}"
            print(
                f"{case:<11} {name:<7} {r['peak_mib']:>9.1f} {r['seconds']:>8.2f} {r['tokens_tokenized']:>17,} "
                f"{r['rows_kept']:>5} "
                f"{r['rows_rejected']:>8} {r['reject_record_bytes']:>13,}  {r['rejects_by_code']}",
                flush=True,
            )
    record("row_memory", figures)


if __name__ == "__main__":
    main()
