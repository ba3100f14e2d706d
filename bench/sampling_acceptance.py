"""Why vLLM's acceptance at temperature > 0 is low: vLLM's own τ as the temperature goes to 0 through its sampled
path, against the expectation under rejection sampling computed outside vLLM.

    python bench/sampling_acceptance.py --recipe demo train.output=runs/demo/train

vLLM (draft_sample_method "greedy", its default) drafts the drafter's argmax
and accepts a drafted token x with probability p_target(x) at the request's
temperature. The offline expectation does the same arithmetic on the
target's fp32 probabilities (transformers): for every anchor of the target's
own replies at that temperature (sampled with seed 0), the drafter's greedy
block d_1..d_w and the expected accepted run sum_k prod_{j<=k} p(d_j | context,
d_<j). τ per anchor = 1 + the mean run (an average over anchors, not vLLM's
walk: at temperature 0 both are printed so the difference shows).

A temperature of 1e-4 samples the greedy reply, so a correct sampler accepts
as at temperature 0. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch
from figures import figure, record  # bench/ is on sys.path when this runs as a script

from raypipe.eval.offline import drafted_blocks


@torch.no_grad()
def expected_runs(drafter, engine, ids: list[int], prompt_len: int, temperature: float) -> list[float]:
    """Expected accepted drafts from every reply anchor with a whole block inside `ids`."""
    w = drafter.block_size - 1
    [states] = engine.extract([ids])
    input_ids = torch.tensor([ids])
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[0, prompt_len : len(ids) - w] = 1
    if not loss_mask.any():
        return []
    anchors, blocks = drafted_blocks(drafter, input_ids, states, loss_mask)
    drafted = blocks.tolist()
    runs = []
    for p, d in zip(anchors, drafted, strict=True):
        target_logits = engine.model(input_ids=torch.tensor([ids[: p + 1] + d[:-1]])).logits[0, p:]
        if temperature == 0:
            probs = torch.nn.functional.one_hot(target_logits.argmax(-1), target_logits.shape[-1]).float()
        else:
            probs = torch.softmax(target_logits / temperature, -1)
        accept = [float(probs[k, d[k]]) for k in range(w)]
        runs.append(sum(float(np.prod(accept[: k + 1])) for k in range(w)))
    return runs


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from raypipe.config import load_config
    from raypipe.eval.evaluate import _export, _local_copy
    from raypipe.eval.offline import load_drafter
    from raypipe.eval.prompts import load_prompts
    from raypipe.eval.spec_decode import generate_in_vllm
    from raypipe.serve.engine import Sampling
    from raypipe.serve.hf_engine import TransformersEngine
    from raypipe.serve.vllm_args import engine_args
    from raypipe.target import resolve_target
    from raypipe.train.drafter import build_drafter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (train.output: the trained run)")
    args = parser.parse_args()
    cfg = load_config(args.recipe, args.overrides)
    target = resolve_target(cfg.serve)
    _, prompts, _ = load_prompts(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        export = _local_copy(_export(cfg), tmp)
        runs = generate_in_vllm(
            engine_args(target, cfg.serve),
            export,
            cfg.train.drafter.block_size - 1,
            prompts,
            [0.0, 1e-4, 0.01, 1.0, 1.0],
            max_tokens=cfg.eval.max_tokens,
        )
        figures = []
        for g in runs:
            s = g.summary()
            again = " again" if any(f["label"] == f"τ in vLLM, T={s['temperature']:g}" for f in figures) else ""
            figures.append(figure(f"τ in vLLM, T={s['temperature']:g}{again}", s["tau"]))
            print(json.dumps({"method": "vllm", **{k: s[k] for k in ("temperature", "tau", "drafts")}}), flush=True)
        engine = TransformersEngine(target.path, target.layer_ids, dtype="float32")
        drafter = load_drafter(build_drafter(target, cfg.train, None), export)
    for temperature in (0.0, 1.0):
        replies = engine.generate(prompts, Sampling(temperature=temperature, max_tokens=cfg.eval.max_tokens, seed=0))
        runs = [
            r
            for p, reply in zip(prompts, replies, strict=True)
            for r in expected_runs(drafter, engine, p + reply, len(p), temperature)
        ]
        figures.append(figure(f"offline rejection sampling τ per anchor, T={temperature:g}", 1 + float(np.mean(runs))))
        print(
            json.dumps(
                {
                    "method": "offline_rejection_sampling",
                    "temperature": temperature,
                    "tau_per_anchor": 1 + float(np.mean(runs)),
                    "anchors": len(runs),
                }
            ),
            flush=True,
        )
    record("sampling_acceptance", figures)


if __name__ == "__main__":
    main()
