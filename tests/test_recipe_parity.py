"""The production recipes as users run them, at tiny scale on CPU: prepare, replies, training, export, evaluation.

`qwen3_8b` and `qwen36_27b` are loaded as shipped; one rule (`scaled_to_cpu`,
written out in docs/design.md, "Recipe parity") replaces the model by the
built-in target of its architecture family, divides every token length by
LENGTH_SCALE and maps the hardware to this machine. Everything else is kept,
and the test checks that it is: a setting a recipe adds is exercised here
without a change to this file, and a setting the rule changes but does not
name fails it. So is every relationship between the lengths (max_length <
max_model_len, max_length = step_tokens, ...), because the division is exact.

The corpus is the production shape the toy configurations never reached:
every conversation is longer than data.max_length, so every row is cut at
exactly data.max_length, and every prompt-only row's prompt is close enough
to the limit that its on-policy reply is cut there too. Storage is the
recipes' own `s3://` layout, on a real S3 API (a local server).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import fsspec
import pytest

from raypipe.config import RaypipeConfig, _set_path, load_config
from raypipe.layout import RunFolders
from raypipe.pipeline import run_pipeline
from raypipe.train.contract_sides import read_drafter
from raypipe.train.ledger import read_training_curve
from raypipe.train.replies import open_rows
from tests.helpers import free_port, qwen_spec

ROOT = Path(__file__).resolve().parents[1]

# The rule. Token lengths (of a row, a pack, a request, a reply) and the anchor counts that scale with them are
# divided by LENGTH_SCALE; the division must be exact, so every relation between them survives.
LENGTH_SCALE = 16
LENGTHS = (
    "data.max_length",
    "serve.max_model_len",
    "serve.max_batch_tokens",
    "train.schedule.step_tokens",
    "train.objective.max_anchors",
    "train.objective.max_pack_anchors",
    "train.replies.max_tokens",
    "eval.max_tokens",
)
# The target, by the production model's architecture family: the built-in random target of that family, whose own
# tokenizer (Qwen's vocabulary, the strict Qwen template) stands in for the model's, as data.tokenizer names it.
FAMILY_TARGETS = {"Qwen/Qwen3-8B": "builtin:tiny", "Qwen/Qwen3.6-27B": "builtin:tiny_qwen36"}
# Hardware and parallelism, to this machine (2 cores, no GPU): vLLM on CPU with an explicit KV cache and no CUDA
# graphs; the trainers on gloo with fractional CPUs, so Ray Data and the engines are not starved.
THIS_MACHINE = {
    "data.num_actors": 2,
    "data.cpus_per_actor": 0.5,
    "serve.num_gpus": 0,
    "serve.tensor_parallel_size": 1,
    "serve.kv_cache_gib": 1,
    "serve.enforce_eager": True,
    "serve.num_cpus": 0.5,
    "serve.resource": None,
    "serve.min_replicas": 1,
    "serve.max_replicas": 1,
    "train.run.num_workers": 2,
    "train.run.use_gpu": False,
    "train.run.cpus_per_worker": 0.25,
    "train.run.resource": None,
}
# How much is run: a few steps across a checkpoint, a few held-out prompts, no latency or K sweep (the demo job's
# test runs them: four more OpenAI servers).
RUN_LENGTH = {
    "train.schedule.max_steps": 4,
    "train.run.checkpoint_every": 2,
    "train.run.log_every": 2,
    "eval.num_prompts": 8,
    "eval.concurrency": [],
    "eval.k_concurrency": [],
    "serve.http_port": None,  # a free port, drawn per run
}


def _get(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf setting by its dotted path (list items by index: data.sources.0.path)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None or not tree:
        return {prefix.rstrip("."): tree}
    return {k: v for key, sub in items for k, v in _flat(sub, f"{prefix}{key}.").items()}


def _rebase(value: Any, bucket: str) -> Any:
    """The recipe's s3://YOUR_BUCKET/... paths, in `bucket` on the local S3 server."""
    return value.replace("s3://YOUR_BUCKET/", f"s3://{bucket}/") if isinstance(value, str) else value


def scaled_to_cpu(recipe: str, bucket: str, storage_options: dict[str, Any]) -> tuple[RaypipeConfig, set[str]]:
    """The shipped recipe under the rule; returns the config and the settings the rule changed by name (every other
    setting of the recipe, its defaults included, is kept)."""
    production = load_config(recipe).model_dump()
    tree = json.loads(json.dumps(production))
    model = production["serve"]["model"]
    if model not in FAMILY_TARGETS:
        raise AssertionError(f"{recipe} targets {model}: add its architecture family's built-in target to the rule")
    changed = {"serve.model", "data.tokenizer"}
    _set_path(tree, "serve.model", FAMILY_TARGETS[model])
    assert production["data"]["tokenizer"] == model, "the recipe's tokenizer is its model's"
    _set_path(tree, "data.tokenizer", FAMILY_TARGETS[model])
    for key in LENGTHS:
        value = _get(production, key)
        assert value % LENGTH_SCALE == 0, f"{recipe}: {key}={value} is not a multiple of {LENGTH_SCALE}"
        _set_path(tree, key, value // LENGTH_SCALE)
    for key, value in {**THIS_MACHINE, **RUN_LENGTH}.items():
        _set_path(tree, key, free_port() if key == "serve.http_port" else value)
    changed |= set(LENGTHS) | set(THIS_MACHINE) | set(RUN_LENGTH)
    for key, value in _flat(production).items():
        if _rebase(value, bucket) != value:
            _set_path(tree, key, _rebase(value, bucket))
            changed.add(key)
    for section in ("data", "train"):
        tree[section]["storage_options"] = storage_options
        changed.add(f"{section}.storage_options")
    return RaypipeConfig.model_validate(tree), changed


def test_the_rule_keeps_every_other_setting_and_every_relation_between_lengths() -> None:
    for recipe in FAMILY_RECIPES:
        production = _flat(load_config(recipe).model_dump())
        cfg, changed = scaled_to_cpu(recipe, "parity", {"key": "k", "secret": "s"})
        scaled = _flat(cfg.model_dump())
        kept = {k for k in production if not any(k == c or k.startswith(c + ".") for c in changed)}
        assert {k: scaled[k] for k in kept} == {k: production[k] for k in kept}
        assert {
            "train.drafter.block_size",
            "train.drafter.draft_layers",
            "train.objective.loss",
            "train.objective.position_weighting",
        } <= kept
        assert {"train.states.mode", "train.run.strategy", "data.enable_thinking", "data.chat_template"} <= kept
        assert "train.drafter.draft_vocab_size" in kept and "train.schedule.epochs" in kept and "serve.dtype" in kept
        for a in LENGTHS:
            for b in LENGTHS:
                assert (production[a] > production[b]) == (scaled[a] > scaled[b]), (a, b)
                assert (production[a] == production[b]) == (scaled[a] == scaled[b]), (a, b)
        assert cfg.data.max_length < cfg.serve.max_model_len and cfg.data.max_length <= cfg.train.schedule.step_tokens


FAMILY_RECIPES = ("qwen3_8b", "qwen36_27b")
TARGET_VOCAB = {"builtin:tiny": 151_936, "builtin:tiny_qwen36": 248_320}
WORDS = (ROOT / "data" / "sample" / "openai" / "part-00000.jsonl").read_text().split()


def _text(rng: random.Random, tokens: int) -> str:
    """Words of the bundled sample, about `tokens` Qwen tokens of them."""
    tok, _ = qwen_spec()
    words = [rng.choice(WORDS) for _ in range(tokens)]
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) > tokens:
        words.pop()
    return " ".join(words)


def long_corpus(max_length: int, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` conversations of each kind, all longer than `max_length` tokens once rendered:
    - complete: a user turn of max_length / 2 tokens and a reply of max_length: cut inside the reply;
    - prompt-only: a user turn whose rendered prompt (the template adds about 13 tokens) ends some 17-47 tokens
      before max_length, so the target's reply is cut at the limit; two of them share one id (rows keep their own
      replies)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(count):
        rows.append(
            {
                "id": f"long-{i}",
                "messages": [
                    {"role": "user", "content": _text(rng, max_length // 2)},
                    {"role": "assistant", "content": _text(rng, max_length)},
                ],
            }
        )
        sid = "twin" if i < 2 else f"open-{i}"
        rows.append(
            {"id": sid, "messages": [{"role": "user", "content": _text(rng, max_length - rng.randint(30, 60))}]}
        )
    return rows


@pytest.mark.integration
@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_the_production_recipe_at_tiny_scale_on_rows_at_the_length_limit(
    recipe: str, ray_cluster: str, s3_server: dict[str, Any]
) -> None:
    bucket = f"raypipe/parity-{recipe}"
    cfg, _ = scaled_to_cpu(recipe, bucket, s3_server)
    limit = cfg.data.max_length
    s3 = fsspec.filesystem("s3", **s3_server)
    corpus = long_corpus(limit, 12)
    s3.pipe_file(f"{bucket}/drafter-data/long.jsonl", "".join(json.dumps(r) + "\n" for r in corpus).encode())
    heldout = long_corpus(limit // 2, 8, seed=1)
    s3.pipe_file(f"{bucket}/drafter-heldout/heldout.jsonl", "".join(json.dumps(r) + "\n" for r in heldout).encode())

    done = run_pipeline(cfg)

    # Data: every row cut at exactly data.max_length; the prompt-only ones leave room for a reply.
    manifest = json.loads(s3.cat_file(f"{bucket}/raypipe/{recipe}/prepared/manifest.json"))
    counts = manifest["counts"]
    assert counts["rows_kept"] == len(corpus) and counts["rows_rejected"] == 0, counts
    assert counts["truncated"] == len(corpus) // 2 and counts["needs_response"] == len(corpus) // 2, counts
    rows = open_rows(cfg)
    rows.load_replies()
    assert all(len(rows.row(i).input_ids) == limit for i in range(len(rows))), "a row short of the limit"
    # Replies: the target's own (never the placeholder), supervised from the prompt's end to the limit.
    for i in range(len(rows)):
        if rows.needs_response[i]:
            row = rows.row(i)
            assert rows.prompt_len[i] < limit and row.loss_mask[rows.prompt_len[i] :].all(), rows.sample_ids[i]
    twins = [rows.row(i).input_ids.tolist() for i, sid in enumerate(rows.sample_ids) if sid == "twin"]
    assert len(twins) == 2 and twins[0] != twins[1]

    # Service and training: the canary passed on every served layer; the steps ran on full-length rows.
    assert done["train"].canary.startswith("canary ok"), done["train"].canary
    curve = read_training_curve(RunFolders.of(cfg).ledger)
    assert [s["step"] for s in curve] == [2, 4]
    assert RunFolders.of(cfg).ray_train.glob(f"{cfg.name}/checkpoint_*/drafter/model.safetensors")

    # Export: the recipe's drafter (block, layers, the target's whole vocabulary), as vLLM loads it.
    drafter = RunFolders.of(cfg).export
    config = drafter.read_json("config.json")
    vocab = TARGET_VOCAB[cfg.serve.model]
    assert config["block_size"] == cfg.train.drafter.block_size and config["draft_vocab_size"] == vocab
    assert config["transformer_layer_config"]["num_hidden_layers"] == cfg.train.drafter.draft_layers
    assert not any(k.startswith("mrope") for k in config["transformer_layer_config"]["rope_parameters"])
    weights = read_drafter(drafter).tensors
    assert "lm_head.weight" not in weights and "d2t" not in weights, "a full-vocabulary drafter uses the target's head"
    assert drafter.read_json("export.json")["contract"]["verdict"] == "ok"  # what it trained with is what vLLM applies

    # Evaluation: vLLM drafted with the exported drafter at the recipe's block size, on the recipe's temperatures.
    doc = json.loads(s3.cat_file(f"{bucket}/raypipe/{recipe}/train/eval/{cfg.name}/eval.json"))
    print(json.dumps({k: doc[k] for k in ("tau", "tau_method", "vllm_refused_drafter")}, indent=1))
    assert done["eval"].tau == doc["tau"] and doc["tau_method"] == "vllm", doc["vllm_refused_drafter"]
    assert [g["temperature"] for g in doc["vllm"]] == cfg.eval.temperatures
    [greedy] = [g for g in doc["vllm"] if g["temperature"] == 0.0]
    assert greedy["drafts"] > 0 and greedy["draft_tokens"] == (cfg.train.drafter.block_size - 1) * greedy["drafts"]
    assert doc["offline_replay"]["steps"] == greedy["drafts"]
