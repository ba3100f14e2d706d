"""Hidden-state extraction: through Ray Serve against the same engine in-process, and vLLM against transformers.

    python bench/serve_throughput.py --batches 24 --seqs 16 --len 256

On the same batches of token ids (tiny Qwen3 target, bf16, layers 1, 2, 4):
1. the vLLM CPU engine (asynchronous, every sequence its own request) called
   in-process, each state file read into a buffer;
2. the same engine inside a Serve replica, called through raypipe's client
   (4 requests in flight; same node: each sequence's states handed over as a
   file and copied once into the caller's buffer);
3. the transformers reference engine in-process.
Prints tokens/s of each, the Serve/in-process ratio, and the bytes a result
moves through Ray per token (the descriptors, pickled, as Ray ships them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

LAYERS = (1, 2, 4)
OUT = Path(__file__).parent / "out"


def make_batches(n: int, seqs: int, length: int) -> list[list[list[int]]]:
    rng = random.Random(0)
    return [[[rng.randrange(150_000) for _ in range(length)] for _ in range(seqs)] for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--len", type=int, default=256)
    args = parser.parse_args()

    import ray
    import torch
    from ray import serve

    from raypipe.assets.tiny_target import build_tiny_target
    from raypipe.config import ServeConfig
    from raypipe.serve.client import HiddenStateClient
    from raypipe.serve.deployment import HiddenStateService
    from raypipe.serve.hf_engine import TransformersEngine
    from raypipe.serve.transport import copy_states, read_array, replica_dir
    from raypipe.serve.vllm_engine import VllmEngine
    from raypipe.target import resolve_target

    model = str(build_tiny_target(OUT / "tiny_target_v3"))
    batches = make_batches(args.batches, args.seqs, args.len)
    tokens = args.batches * args.seqs * args.len
    cfg = ServeConfig(
        model=model,
        layer_ids=list(LAYERS),
        dtype="bfloat16",
        max_model_len=args.len + 16,
        max_sequences=args.seqs,
        max_batch_tokens=args.seqs * args.len,
        kv_cache_gib=2,
        enforce_eager=True,
        num_gpus=0,
        num_cpus=1,
        resource=None,
        canary="off",
    )
    buffer = torch.empty(args.len, len(LAYERS), 64, dtype=torch.bfloat16)

    async def in_process() -> float:
        engine = VllmEngine(resolve_target(cfg), cfg, replica_dir())

        async def extract(batch: list[list[int]]) -> None:
            paths = await asyncio.gather(*(engine.extract(ids) for ids in batch))
            for path, ids in zip(paths, batch):
                copy_states(read_array(path, ids), buffer)

        await extract(batches[0])  # warm-up
        start = time.perf_counter()
        for batch in batches:
            await extract(batch)
        seconds = time.perf_counter() - start
        engine.close()
        return seconds

    t_inproc = asyncio.run(in_process())

    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    handle = serve.run(
        HiddenStateService.options(ray_actor_options={"num_cpus": 1}).bind(cfg), name="bench", route_prefix=None
    )
    client = HiddenStateClient(handle, max_in_flight=4)
    for states in client.extract(batches[0]):
        copy_states(states, buffer)
    start = time.perf_counter()
    bytes_through_ray = 0
    for results in client.stream(batches):
        bytes_through_ray += len(pickle.dumps(results))
        for states in results:
            copy_states(states, buffer)
    t_serve = time.perf_counter() - start
    serve.shutdown()
    ray.shutdown()

    hf = TransformersEngine(model, LAYERS)
    hf.extract(batches[0])
    start = time.perf_counter()
    for batch in batches:
        hf.extract(batch)
    t_hf = time.perf_counter() - start
    record(
        "serve_throughput",
        [
            figure("Serve over in-process", t_inproc / t_serve, "x", at_least=0.9),
            figure("vLLM in-process", round(tokens / t_inproc), "tokens/s"),
            figure("through Serve and the client", round(tokens / t_serve), "tokens/s"),
            figure("bytes through Ray per token", bytes_through_ray / tokens, "B"),
        ],
    )
    print(
        json.dumps(
            {
                "batches": args.batches,
                "seqs_per_batch": args.seqs,
                "tokens_per_seq": args.len,
                "tokens": tokens,
                "vllm_inprocess_tokens_per_s": round(tokens / t_inproc),
                "vllm_serve_tokens_per_s": round(tokens / t_serve),
                "transformers_inprocess_tokens_per_s": round(tokens / t_hf),
                "ratio_serve_over_inprocess": round(t_inproc / t_serve, 3),
                "ratio_vllm_over_transformers": round(t_hf / t_inproc, 3),
                "bytes_through_ray_per_token": round(bytes_through_ray / tokens, 2),
                "state_bytes_per_token": len(LAYERS) * 64 * 2,
                "wall_s": {
                    "vllm_inprocess": round(t_inproc, 2),
                    "serve": round(t_serve, 2),
                    "transformers": round(t_hf, 2),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
