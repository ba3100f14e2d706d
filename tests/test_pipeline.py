"""Qwen3.6's architecture through the whole pipeline on CPU, with the real vLLM CPU engine.

The tiny Qwen3.6-architecture target (`builtin:tiny_qwen36`: composite config,
Gated DeltaNet + gated attention layers, a vision tower, vocabulary 248,320)
goes through prepare -> service (extraction, parity canary) -> on-policy
replies -> train -> export -> evaluation in vLLM with the exported DFlash
drafter. The drafter has a draft vocabulary of 4,096 of the 248,320 tokens
(`train.draft_vocab_size`). The target is random, so τ stays near 1; what is
checked is that every stage runs on the production architecture and its
contracts hold, and that vLLM loads and drafts with the reduced drafter.
(Greedy replies with any drafter, full vocabulary or reduced, differ from
those without at a few near-tied positions of this random target:
BENCHMARKS.md; the demo's test checks losslessness on a target that learned.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from raypipe.config import load_config
from raypipe.layout import RunFolders
from raypipe.pipeline import run_pipeline
from raypipe.train.ledger import read_training_curve
from raypipe.train.replies import open_rows
from tests.conftest import free_port

pytestmark = pytest.mark.integration
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample"
ENDOFTEXT, IM_END = 151_643, 151_645


def test_tiny_qwen36_pipeline_end_to_end(ray_cluster: str, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    for name, rows in (("openai", 60), ("sharegpt", 40)):
        lines = (SAMPLE / name / "part-00000.jsonl").read_text().splitlines()[:rows]
        (tmp_path / "src" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    twins = [
        {"id": "twin", "messages": [{"role": "user", "content": text}]}
        for text in ("Name three rivers.", "Count to five, please.")
    ]
    (tmp_path / "src" / "twins.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in twins)
    )  # one sample_id, two prompts
    cfg = load_config(
        "tiny_qwen36",
        [
            f"data.sources=[{{path: {tmp_path}/src/*.jsonl}}]",
            f"data.output={tmp_path}/prepared",
            f"train.output={tmp_path}/train",
            "train.epochs=3",
            "train.max_steps=12",  # CI's time: 12 steps still cross two epochs' ends and two checkpoints
            "train.checkpoint_every=6",
            "train.log_every=4",
            "train.draft_vocab_size=4096",
            "train.reply_max_tokens=16",
            "eval.num_prompts=8",
            "eval.max_tokens=16",
            "eval.concurrency=[]",  # the latency sweep runs in the demo job's test
            f"serve.http_port={free_port()}",
        ],
    )
    done = run_pipeline(cfg)

    # Data: the tokenizer names <|endoftext|> as eos; the turn end comes from the template.
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["end_of_turn"] == {"token": "<|im_end|>", "id": IM_END}
    assert manifest["counts"]["rows_kept"] > 100 and manifest["counts"]["needs_response"] > 0

    # Service: the replica passed the parity canary against transformers (canary: refuse would have stopped it).
    assert done["train"]["canary"].startswith("canary ok"), done["train"]["canary"]

    # Replies: one per needs_response row, each ending at the end-of-turn token if the target emitted it.
    replies = [
        r
        for f in sorted((tmp_path / "train" / "replies").glob("*.parquet"))
        for r in pq.read_table(f).column("reply_ids").to_pylist()
    ]
    assert len(replies) == manifest["counts"]["needs_response"]
    assert all(IM_END not in r[:-1] and 0 < len(r) <= 16 for r in replies)
    # The two rows that share a sample_id got a reply each, to their own prompt (replies are keyed by row position).
    rows = open_rows(cfg)
    rows.load_replies()
    twins = [i for i, sid in enumerate(rows.sample_ids) if sid == "twin"]
    assert len(twins) == 2 and rows.row(twins[0]).input_ids.tolist() != rows.row(twins[1]).input_ids.tolist()

    # Training: the drafter for the composite target trained to the last step; the export is what vLLM loads.
    curve = read_training_curve(RunFolders.of(cfg).ledger)
    assert curve[-1]["step"] == 12 and sum(s["steps"] for s in curve) == 12
    drafter = json.loads((tmp_path / "train" / "drafter" / "config.json").read_text())
    assert drafter["draft_vocab_size"] == 4096 and drafter["speculators_config"]["verifier"]["architectures"] == [
        "Qwen3_5ForConditionalGeneration"
    ]
    weights = load_file(str(tmp_path / "train" / "drafter" / "model.safetensors"))
    assert weights["lm_head.weight"].shape[0] == 4096 and weights["d2t"].shape == (4096,)  # vLLM maps drafts with d2t
    assert not any(k.startswith("mrope") for k in drafter["transformer_layer_config"]["rope_parameters"])

    # Evaluation: vLLM ran DFlash speculative decoding with the exported drafter on the hybrid target.
    doc = json.loads((tmp_path / "train" / "eval" / "eval.json").read_text())
    print(
        json.dumps(
            {k: doc[k] for k in ("tau", "tau_method", "vllm_refused_drafter", "offline_replay", "training")}, indent=1
        )
    )
    print(json.dumps(doc["vllm"], indent=1))
    assert done["eval"]["tau"] == doc["tau"]
    assert doc["tau_method"] == "vllm" and doc["vllm_refused_drafter"] is None, doc["vllm_refused_drafter"]
    [greedy] = [g for g in doc["vllm"] if g["temperature"] == 0.0]
    assert (
        greedy["drafts"] > 0
        and greedy["draft_tokens"] == 3 * greedy["drafts"]
        and len(greedy["accepted_per_position"]) == 3
    )
    assert doc["offline_replay"]["steps"] == greedy["drafts"]  # the replay walks vLLM's own verification steps
    assert doc["vllm_untrained_drafter"]["drafts"] > 0
    # The draft vocabulary's cost and reach: the step with 4,096 of 248,320 head rows, the replies' tokens it holds.
    vocab = doc["draft_vocab"]
    assert vocab["size"] == 4096 and vocab["target_vocab_size"] == 248_320, vocab
    # The random target's greedy tokens are its frequent ones (0.21 measured); at T=1 it samples all 248,320 (0.0).
    greedy_share, sampled_share = vocab["reply_tokens_in_vocab"]
    assert greedy_share["temperature"] == 0.0 and 0 < greedy_share["share"] <= 1, vocab
    assert sampled_share["temperature"] == 1.0 and 0 <= sampled_share["share"] < greedy_share["share"], vocab
    assert vocab["drafter_step_ms"]["draft_vocab"] > 0 and vocab["full_over_draft"] > 0
