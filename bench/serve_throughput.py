"""Hidden-state extraction: through Ray Serve against the same engine in-process, and vLLM against transformers.

    python bench/serve_throughput.py --batches 24 --seqs 16 --len 256

On the same batches of token ids (tiny Qwen3 target, layers 1, 2, 4):
1. the vLLM CPU engine called in-process;
2. the same engine inside a Serve replica, called through raypipe's client
   (4 requests in flight, bf16 results back to the caller);
3. the transformers reference engine in-process.
Prints tokens/s of each, the Serve/in-process ratio, and the bytes a result
moves per token (pickled, as Ray ships it).
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from pathlib import Path


LAYERS = (1, 2, 4)
OUT = Path(__file__).parent / "out"


def make_batches(n: int, seqs: int, length: int) -> list[list[list[int]]]:
    rng = random.Random(0)
    return [[[rng.randrange(150_000) for _ in range(length)] for _ in range(seqs)] for _ in range(n)]


def timed(fn, batches) -> tuple[float, list]:
    fn(batches[0])  # warm-up
    start = time.perf_counter()
    out = [fn(b) for b in batches]
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--len", type=int, default=256)
    args = parser.parse_args()

    import ray
    from ray import serve

    from raypipe.assets.tiny_target import build_tiny_target
    from raypipe.config import ServeConfig
    from raypipe.serve.client import HiddenStateClient
    from raypipe.serve.deployment import HiddenStateService
    from raypipe.serve.hf_engine import TransformersEngine
    from raypipe.serve.vllm_engine import VllmEngine
    from raypipe.target import resolve_target

    model = str(build_tiny_target(OUT / "tiny_target_v3"))
    batches = make_batches(args.batches, args.seqs, args.len)
    tokens = args.batches * args.seqs * args.len
    cfg = ServeConfig(
        model=model, layer_ids=list(LAYERS), dtype="bfloat16", max_model_len=args.len + 16, max_sequences=args.seqs, max_batch_tokens=args.seqs * args.len,
        kv_cache_gib=2, enforce_eager=True, num_gpus=0, num_cpus=1, resource=None, canary="off",
    )
    engine = VllmEngine(resolve_target(cfg), cfg)
    t_inproc, _ = timed(engine.extract, batches)
    engine.close()
    del engine

    ray.init(num_cpus=2, logging_level="ERROR", include_dashboard=False)
    app = HiddenStateService.options(ray_actor_options={"num_cpus": 1}).bind(cfg)
    handle = serve.run(app, name="bench", route_prefix=None)
    client = HiddenStateClient(handle, max_in_flight=4)
    client.extract(batches[0])
    start = time.perf_counter()
    results = list(client.stream(batches))
    t_serve = time.perf_counter() - start
    bytes_per_token = len(pickle.dumps(results[0])) / (args.seqs * args.len)
    serve.shutdown()
    ray.shutdown()

    t_hf, _ = timed(TransformersEngine(model, LAYERS).extract, batches)
    print(
        json.dumps(
            {
                "batches": args.batches, "seqs_per_batch": args.seqs, "tokens_per_seq": args.len, "tokens": tokens,
                "vllm_inprocess_tokens_per_s": round(tokens / t_inproc),
                "vllm_serve_tokens_per_s": round(tokens / t_serve),
                "transformers_inprocess_tokens_per_s": round(tokens / t_hf),
                "ratio_serve_over_inprocess": round(t_inproc / t_serve, 3),
                "ratio_vllm_over_transformers": round(t_hf / t_inproc, 3),
                "result_bytes_per_token": round(bytes_per_token, 1),
                "raw_state_bytes_per_token": len(LAYERS) * 64 * 2,
                "wall_s": {"vllm_inprocess": round(t_inproc, 2), "serve": round(t_serve, 2), "transformers": round(t_hf, 2)},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
