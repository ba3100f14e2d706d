"""The canary's transformers reference at the largest target this machine holds: the whole model (before issue 39)
against the layer-streamed reference (raypipe.serve.streamed_reference), side by side in one run.

    python bench/canary_scale.py [--layers 24]

The target is Qwen3.6-27B's architecture (raypipe.assets.tiny_target.qwen36_config: Gated DeltaNet and gated
attention layers, 3 to 1, the composite checkpoint with its vision tower) at hidden size 2048 with Qwen3.6's
248,320-row vocabulary, random bf16 weights written as safetensors shards in code (5.3 GiB at 24 layers). Each arm
runs in its own process, one thread, with the replica's malloc settings (raypipe.heap.HEAP_ENV), and computes the
canary's reference (bf16, the canary prompts, DFlash's default layer ids) from the files in the page cache; it
reports its peak resident memory (VmHWM), the memory of the process before the reference (Python, torch,
transformers imported), what stays resident at the end (the whole model's weights are mapped safetensors pages,
which count in its RSS until it is freed) and the wall time. The two arms' states must be equal. Then the 27B
estimate of the streamed reference: raypipe.serve.canary.reference_bytes on the published Qwen3.6-27B config (the
measured peak over the imports must stay within its figure for this target, also when the reference is computed
4 times in one process, as deep a heap as a 96-layer target's), and its time at the measured rate, in seconds per GB
of decoder weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import figure, record  # bench/ is on sys.path when this runs as a script

from raypipe.heap import HEAP_ENV

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 1 << 30
REPEATS = 4  # the reference computed again in the same process: the heap of a target 4x as deep


def synthetic_config(layers: int) -> Any:
    """Qwen3.6-27B's architecture at hidden size 2048 (27B: 5120), its vocabulary, `layers` decoder layers."""
    from raypipe.assets.tiny_target import qwen36_config

    return qwen36_config(
        {
            "vocab_size": 248_320,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": layers,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "max_position_embeddings": 4096,
            "bos_token_id": 151_643,
            "eos_token_id": 151_643,
        },
        (151_655, 151_656, 151_652, 151_653),
    )


def write_target(directory: Path, layers: int) -> int:
    """The synthetic target's config and random bf16 weights in 1 GiB shards with their index, one tensor in memory
    at a time; returns the weights' bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    config = synthetic_config(layers)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Qwen3_5ForConditionalGeneration(config).state_dict().items()}
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in shapes.items():
        if len(shape) == 1:  # norms, biases, Gated DeltaNet's A_log and dt_bias: ones keep every state finite
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(0.02)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        total += tensor.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def memory() -> dict[str, int]:
    """This process's peak resident memory (VmHWM: of this program only, unlike ru_maxrss, which a child keeps from
    the parent it forked from) and its resident memory now, anonymous and file-backed (mapped weights), in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmHWM", "RssAnon", "RssFile")}


def arm(name: str, model: str, states_path: str) -> dict:
    """One arm in this process: the canary's reference on the canary prompts, as raypipe.serve.canary computes it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from raypipe.serve.canary import canary_prompts
    from raypipe.serve.hf_engine import TransformersEngine
    from raypipe.serve.streamed_reference import StreamedReference
    from raypipe.target import TargetShape, default_layer_ids

    layer_ids = default_layer_ids(TargetShape.of(AutoConfig.from_pretrained(model)).num_layers)
    baseline = memory()["VmHWM"]
    start = time.perf_counter()
    if name == "whole":
        reference = TransformersEngine(model, layer_ids, dtype="bfloat16")
    else:
        reference = StreamedReference(model, layer_ids, dtype=torch.bfloat16)
    states = reference.extract(canary_prompts(reference.vocab_size))
    seconds = time.perf_counter() - start
    end = memory()  # the reference still held: the whole model's weights, or nothing of the streamed one's
    save_file({str(i): s for i, s in enumerate(states)}, states_path)
    for _ in range(REPEATS - 1):  # the heap of a target 4x as deep: under HEAP_ENV, fragments among activations stay
        reference.extract(canary_prompts(reference.vocab_size))
    return {
        "arm": name,
        "layer_ids": list(layer_ids),
        "seconds": round(seconds, 1),
        "baseline_mib": baseline,
        "peak_rss_mib": end["VmHWM"],
        "end_anon_mib": end["RssAnon"],
        "end_file_mib": end["RssFile"],
        "peak_rss_repeated_mib": memory()["VmHWM"],
    }


def whole_model_bytes(config: Any) -> int:
    """The bf16 weights the whole-model reference loads: the language model with its embedding and LM head."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * 2


def run_arm(name: str, model: str, states_path: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--arm", name, "--model", model, "--states", states_path],
        env={**os.environ, "OMP_NUM_THREADS": "1", **HEAP_ENV},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers, a multiple of 4")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # in the arm's own process: whole or streamed
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--states", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, args.model, args.states)), flush=True)
        return

    import torch
    from safetensors.torch import load_file

    from raypipe.assets.published import qwen36_27b
    from raypipe.serve.canary import decoder_layer_bytes, reference_bytes
    from raypipe.sizing import GIB

    work = Path(tempfile.mkdtemp(prefix="canary_scale_"))
    model = work / "target"
    model.mkdir()
    weights = write_target(model, args.layers)
    print(json.dumps({"target_gib": round(weights / GIB, 2), "at": str(model)}), flush=True)
    results = {}
    for name in ("whole", "streamed"):
        results[name] = run_arm(name, str(model), str(work / f"{name}.safetensors"))
        print(json.dumps(results[name]), flush=True)
    whole, streamed = (load_file(work / f"{n}.safetensors") for n in ("whole", "streamed"))
    equal = all(torch.equal(whole[k], streamed[k]) for k in whole) and whole.keys() == streamed.keys()
    assert equal, "the streamed reference's states differ from the whole model's"

    whole_run, streamed_run = results["whole"], results["streamed"]
    decoder_gb = sum(decoder_layer_bytes(synthetic_config(args.layers))) / 1e9
    big = qwen36_27b()
    big_decoder_gb = sum(decoder_layer_bytes(big)) / 1e9
    estimate = {
        "streamed_over_imports_gib": round(reference_bytes(synthetic_config(args.layers)) / GIB, 2),
        "seconds_per_decoder_gb": round(streamed_run["seconds"] / decoder_gb, 2),
        "qwen36_27b_whole_model_gb": round(whole_model_bytes(big) / 1e9, 1),
        "qwen36_27b_peak_gib": round(reference_bytes(big) / GIB + streamed_run["baseline_mib"] / 1024, 2),
        "qwen36_27b_seconds": round(streamed_run["seconds"] / decoder_gb * big_decoder_gb),
    }
    print(json.dumps(estimate), flush=True)
    for path in work.rglob("*.safetensors"):
        path.unlink()
    record(
        "canary_scale",
        [
            figure(f"synthetic Qwen3.6-architecture target, {args.layers} layers, bf16 weights", weights / GIB, "GiB"),
            figure("whole model (before): peak RSS", whole_run["peak_rss_mib"] / 1024, "GiB"),
            figure("whole model (before): of it, weights mapped at the end", whole_run["end_file_mib"] / 1024, "GiB"),
            figure("streamed: peak RSS", streamed_run["peak_rss_mib"] / 1024, "GiB"),
            figure("the process before the reference (imports)", streamed_run["baseline_mib"] / 1024, "GiB"),
            figure(
                "streamed: peak over the imports",
                (streamed_run["peak_rss_mib"] - streamed_run["baseline_mib"]) / 1024,
                "GiB",
                at_most=estimate["streamed_over_imports_gib"],
            ),
            figure(
                f"streamed: peak over the imports, computed {REPEATS} times in one process",
                (streamed_run["peak_rss_repeated_mib"] - streamed_run["baseline_mib"]) / 1024,
                "GiB",
                at_most=estimate["streamed_over_imports_gib"],
            ),
            figure("whole model (before): time", whole_run["seconds"], "s"),
            figure("streamed: time", streamed_run["seconds"], "s"),
            figure("streamed: time per GB of decoder weights", estimate["seconds_per_decoder_gb"], "s"),
            figure("states equal, streamed and whole", int(equal)),
            figure("Qwen3.6-27B whole model (before): weights", estimate["qwen36_27b_whole_model_gb"], "GB"),
            figure("Qwen3.6-27B streamed: peak RSS, estimated", estimate["qwen36_27b_peak_gib"], "GiB"),
            figure("Qwen3.6-27B streamed: time, estimated at the rate above", estimate["qwen36_27b_seconds"], "s"),
        ],
    )


if __name__ == "__main__":
    main()
