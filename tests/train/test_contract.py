"""The serving contract: real drafters on the tiny targets, each broken in one item, checked with vLLM's own
conversion of their config.json; the export records the contract and refuses a broken drafter; the check command."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from raypipe.cli import main
from raypipe.config import TrainConfig, load_config
from raypipe.layout import RunFolders
from raypipe.storage import Storage
from raypipe.target import Target, load_target, resolve_model
from raypipe.train.checkpoint import CONFIG_FILE, DRAFTER_DIR, PROVENANCE_FILE, STATE_FILE
from raypipe.train.contract import ITEMS, Contract, ContractError, TargetFacts, check_drafter
from raypipe.train.export import export_checkpoint

TARGETS = {"qwen3": "builtin:tiny", "qwen36": "builtin:tiny_qwen36"}
RECIPES = {"qwen3": "debug_cpu", "qwen36": "tiny_qwen36"}
DRAFT_VOCAB = {"qwen3": None, "qwen36": 4096}  # the Qwen3.6 drafter keeps a draft vocabulary (d2t/t2d)
# DFlash's default layers: of the 4-layer Qwen3, aux [1] then the last layer; of the 8-layer Qwen3.6, aux [1..5], 8
SERVED = {"qwen3": [1, 4], "qwen36": [1, 2, 3, 4, 5, 8]}


@pytest.fixture(scope="module")
def targets(raypipe_cache: Path) -> dict[str, Target]:
    return {arch: load_target(name, resolve_model(name)) for arch, name in TARGETS.items()}


@pytest.fixture(scope="module")
def facts(targets: dict[str, Target]) -> dict[str, TargetFacts]:
    return {arch: TargetFacts.load(t.path) for arch, t in targets.items()}


@pytest.fixture(scope="module")
def drafters(targets: dict[str, Target], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A freshly built drafter per tiny target, saved as the checkpoint saves it (raypipe.train.drafter)."""
    from raypipe.train.drafter import build_drafter
    from raypipe.train.vocab import vocab_from_counts

    out = {}
    for arch, target in targets.items():
        size = DRAFT_VOCAB[arch]
        tc = TrainConfig(
            output="unused",
            drafter={"draft_layers": 1, "block_size": 4, "draft_vocab_size": size},
            run={"use_gpu": False},
        )
        vocab = None
        if size is not None:
            counts = np.zeros(target.shape.vocab_size, np.int64)
            counts[:20_000] = np.random.default_rng(0).integers(1, 100, 20_000)
            vocab = vocab_from_counts(counts, size)
        out[arch] = tmp_path_factory.mktemp(f"drafter_{arch}")
        build_drafter(target, tc, vocab).save_pretrained(out[arch])
    return out


def variant(
    base: Path,
    to: Path,
    config: Callable[[dict[str, Any]], None] | None = None,
    weights: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """A copy of the drafter at `base` with its config.json or its weights edited."""
    shutil.copytree(base, to)
    if config is not None:
        doc = json.loads((to / "config.json").read_text())
        config(doc)
        (to / "config.json").write_text(json.dumps(doc))
    if weights is not None:
        tensors = load_file(to / "model.safetensors")
        weights(tensors)
        save_file(tensors, to / "model.safetensors")
    return to


def check(directory: Path, target: TargetFacts, configured: int | None = None) -> Contract:
    return check_drafter(
        Storage(str(directory), {}),
        target,
        configured_mask_token_id=configured,
        served_layer_ids=SERVED["qwen36" if target.shape.hybrid else "qwen3"],
    )


def failing(contract: Contract) -> set[tuple[str, str]]:
    return {(c.item, c.field) for c in contract.checks if not c.ok}


def rope(**update: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["transformer_layer_config"]["rope_parameters"].update(update)


def layer(**update: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["transformer_layer_config"].update(update)


def top(**update: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.update(update)


def drop(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda w: w.pop(name)


def shift_last_d2t(w: dict[str, np.ndarray]) -> None:
    w["d2t"][-1] += 1_000_000


# (drafter, config edit, weights edit, the checks that must fail, a part of the message)
MISMATCHES = {
    # 1. rotary: the target's partial_rotary_factor 0.25 kept (no MRoPE full-head hack): training rotates all 32 dims
    "rotary: partial_rotary_factor": (
        "qwen36",
        rope(partial_rotary_factor=0.25),
        None,
        {("rotary", "rotated dims")},
        "trained rotating 32 of its 32 head dims (speculators' Qwen3RotaryEmbedding rotates the whole head, ignoring "
        "partial_rotary_factor) but vLLM will rotate 8 (head_dim 32 x partial_rotary_factor 0.25)",
    ),
    "rotary: is_neox_style": (
        "qwen3",
        layer(is_neox_style=False),
        None,
        {("rotary", "style")},
        "vLLM will rotate interleaved (gpt-j)",
    ),
    # 2. M-RoPE keys: what speculators' hack leaves in the config before raypipe strips them
    "mrope: mrope_section": (
        "qwen36",
        rope(mrope_section=[8, 4, 4]),
        None,
        {("mrope", "M-RoPE keys")},
        "transformer_layer_config.rope_parameters.mrope_section: the drafter trained with 1-D RoPE",
    ),
    "mrope: mrope_interleaved": (
        "qwen36",
        rope(mrope_interleaved=True),
        None,
        {("mrope", "M-RoPE keys")},
        "transformer_layer_config.rope_parameters.mrope_interleaved:",
    ),
    # 3. the mask token's embedding row
    "mask: outside the embedding": (
        "qwen3",
        top(mask_token_id=151_936),
        None,
        {("mask_token", "mask embedding")},
        "mask_token_id: 151936 is outside the target's embedding (151936 rows)",
    ),
    "mask: none": (
        "qwen3",
        top(mask_token_id=None),
        None,
        {("mask_token", "mask_token_id")},
        "mask_token_id: config.json sets none, so vLLM has no token to fill draft slots with",
    ),
    "mask: a text token": (
        "qwen3",
        top(mask_token_id=9707),
        None,
        {("mask_token", "mask token kind")},
        "mask_token_id: 9707 is the text token 'Hello' and train.drafter.mask_token_id did not choose it",
    ),
    # 4. target layer ids
    "layers: outside the target": (
        "qwen3",
        top(aux_hidden_state_layer_ids=[5]),
        None,
        {("target_layers", "aux_hidden_state_layer_ids in the target"), ("target_layers", "served in training")},
        "[5] do not exist in the target's 4 layers (vLLM captures ids 0..4",
    ),
    "layers: not the ones served": (
        "qwen3",
        top(aux_hidden_state_layer_ids=[2]),
        None,
        {("target_layers", "served in training")},
        "config.json names [2] but training read the target's layers [1]",
    ),
    # 5. non-causal draft blocks
    "non-causal: sliding_window_non_causal": (
        "qwen3",
        top(sliding_window_non_causal=False),
        None,
        {("non_causal", "attention in a draft block")},
        "the drafter trained ['full, non-causal'] (speculators attends non-causally in full-attention layers whatever "
        "the flag), vLLM will attend ['full, causal']",
    ),
    # 6. hidden size and the draft vocabulary
    "hidden: hidden_size": (
        "qwen3",
        layer(hidden_size=128),
        None,
        {("hidden_vocab", "hidden_size"), ("hidden_vocab", "fc.weight")},
        "transformer_layer_config.hidden_size: the drafter is 128 wide, the target 64",
    ),
    "vocab: vocab_size": (
        "qwen3",
        layer(vocab_size=151_643),
        None,
        {("hidden_vocab", "vocab_size")},
        "the drafter's is 151643, the target's 151936",
    ),
    "vocab: no d2t": (
        "qwen36",
        None,
        drop("d2t"),
        {("hidden_vocab", "draft vocabulary")},
        "the weights hold no d2t for 4096 draft ids",
    ),
    "vocab: d2t out of range": (
        "qwen36",
        None,
        shift_last_d2t,
        {("hidden_vocab", "draft vocabulary")},
        "d2t: draft ids map to target ids outside [0, 248320)",
    ),
    "vocab: draft_vocab_size": (
        "qwen36",
        top(draft_vocab_size=8192),
        None,
        {("hidden_vocab", "draft vocabulary")},
        "d2t of shape [4096] for 8192 draft ids",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_each_mismatch_fails_naming_its_field_both_values_and_the_fix(
    case: str, drafters: dict[str, Path], facts: dict[str, TargetFacts], tmp_path: Path
) -> None:
    arch, config, weights, fails, message = MISMATCHES[case]
    contract = check(variant(drafters[arch], tmp_path / "drafter", config, weights), facts[arch])
    assert failing(contract) == fails, contract.table()
    assert any(message in p for p in contract.problems), contract.problems
    with pytest.raises(ContractError, match=r"does not match what vLLM will apply") as refused:
        contract.require()
    assert message in str(refused.value) and "raypipe check-drafter" in str(refused.value)


def test_a_mask_embedding_file_is_named_as_vllm_replaces_the_row_with_it(
    drafters: dict[str, Path], facts: dict[str, TargetFacts], tmp_path: Path
) -> None:
    directory = variant(drafters["qwen3"], tmp_path / "drafter")
    (directory / "mask_embedding.pt").write_bytes(b"")  # vLLM's DFlash loads it in place of the mask token's row
    contract = check(directory, facts["qwen3"])
    assert failing(contract) == {("mask_token", "mask embedding")}
    assert contract.problems == [
        "mask_embedding.pt: vLLM replaces the target's row 151669 with it, while the drafter trained with that row "
        "itself; delete the file from the drafter directory"
    ]


def test_a_config_vllm_cannot_read_is_refused_naming_vllms_error(
    drafters: dict[str, Path], facts: dict[str, TargetFacts], tmp_path: Path
) -> None:
    directory = variant(drafters["qwen3"], tmp_path / "drafter", lambda c: c.pop("mask_token_id"))
    with pytest.raises(ContractError, match=r"config.json: vLLM cannot read it \(KeyError: 'mask_token_id'\)"):
        check(directory, facts["qwen3"])


def test_a_text_token_the_run_chose_as_mask_passes(
    drafters: dict[str, Path], facts: dict[str, TargetFacts], tmp_path: Path
) -> None:
    directory = variant(drafters["qwen3"], tmp_path / "drafter", top(mask_token_id=9707))
    assert not check(directory, facts["qwen3"], configured=9708).ok  # another id chosen: still refused
    contract = check(directory, facts["qwen3"], configured=9707)
    assert contract.ok, contract.table()
    [kind] = [c for c in contract.checks if c.field == "mask token kind"]
    assert kind.trained == "text token 'Hello' (train.drafter.mask_token_id)"


def _checkpoint(drafter: Path, root: Path, target: Target) -> Storage:
    """A checkpoint directory as the training loop writes it (raypipe.train.checkpoint), around `drafter`."""
    shutil.copytree(drafter, root / DRAFTER_DIR)
    (root / STATE_FILE).write_text(json.dumps({"epoch": 0, "step": 1, "cursor": 0}))
    (root / CONFIG_FILE).write_text(json.dumps({"name": "contract"}))
    (root / PROVENANCE_FILE).write_text(
        json.dumps({"target": target.name, "target_path": target.path, "layer_ids": list(target.layer_ids)})
    )
    return Storage(str(root), {})


@pytest.mark.parametrize("arch", list(TARGETS))
def test_the_export_of_each_tiny_target_passes_and_export_json_holds_the_contract(
    arch: str, drafters: dict[str, Path], targets: dict[str, Target], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = load_config(RECIPES[arch], [f"train.output={tmp_path / 'train'}"])
    doc = export_checkpoint(cfg, _checkpoint(drafters[arch], tmp_path / "ckpt", targets[arch]), str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "export.json").read_text())
    assert written["contract"] == json.loads(json.dumps(doc["contract"]))
    contract = written["contract"]
    assert contract["verdict"] == "ok" and sorted(contract["items"]) == sorted(ITEMS)
    assert all(contract["items"][item] for item in ITEMS)
    assert all(c["problem"] == "" for item in contract["items"].values() for c in item)
    values = {c["field"]: (c["trained"], c["vllm"]) for item in contract["items"].values() for c in item}
    # What speculators trained with and what vLLM will apply, side by side: one rotation over the whole 32-dim head.
    assert values["rotated dims"] == ("32 of 32", "32 of 32")
    assert values["cos/sin"] == ("Qwen3RotaryEmbedding (default)", "RotaryEmbedding, max |diff| 0")
    assert values["M-RoPE keys"] == ("1-D RoPE", "1-D RoPE")
    assert values["mask_token_id"] == (151_669, 151_669) and values["mask token kind"] == ("unused row", "unused row")
    aux = SERVED[arch][:-1]
    assert values["aux_hidden_state_layer_ids"] == (aux, aux)
    assert values["attention in a draft block"] == (["full, non-causal"], ["full, non-causal"])
    assert (
        contract["inputs"]["served_layer_ids"] == SERVED[arch]
        and contract["inputs"]["configured_mask_token_id"] is None
    )
    if arch == "qwen36":  # the target rotates a quarter of its head with M-RoPE; the drafter, all of it with RoPE
        assert contract["inputs"]["target_rope_parameters"]["partial_rotary_factor"] == 0.25
        assert "mrope_section" in contract["inputs"]["target_rope_parameters"]
        assert values["rope_theta"] == (10_000_000.0, 10_000_000.0)
        assert values["draft vocabulary"] == ("4096 of 248320", "4096 of 248320")
    else:
        assert values["draft vocabulary"] == ("151936 of 151936", "151936 of 151936")

    # The check command finds the target in export.json and passes.
    assert main(["check-drafter", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"with target {targets[arch].path}" in out and f"{len(values)} checks, 0 failed" in out


def test_a_refused_export_names_the_mismatch_and_keeps_the_previous_export(
    drafters: dict[str, Path], targets: dict[str, Target], tmp_path: Path
) -> None:
    cfg = load_config("debug_cpu", [f"train.output={tmp_path / 'train'}"])
    out = tmp_path / "out"
    export_checkpoint(cfg, _checkpoint(drafters["qwen3"], tmp_path / "good", targets["qwen3"]), str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    broken = _checkpoint(drafters["qwen3"], tmp_path / "broken", targets["qwen3"])
    config = Path(broken.path(DRAFTER_DIR, "config.json"))
    config.write_text(json.dumps({**json.loads(config.read_text()), "sliding_window_non_causal": False}))
    with pytest.raises(ContractError, match=r"sliding_window_non_causal=false: per draft layer") as refused:
        export_checkpoint(cfg, broken, str(out))
    assert f"the drafter at {broken.url}/drafter does not match" in str(refused.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the refused export touched the previous one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "good", "out"], "a staging directory was left"


def test_check_drafter_command_prints_the_table_and_exits_1_on_a_mismatch(
    drafters: dict[str, Path], targets: dict[str, Target], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = variant(drafters["qwen36"], tmp_path / "drafter", rope(partial_rotary_factor=0.25))
    # No export.json here: the target must be named.
    assert main(["check-drafter", str(directory)]) == 2
    assert "has no export.json naming its target: pass the target (--target PATH_OR_ID)" in capsys.readouterr().err

    assert main(["check-drafter", str(directory), "--target", "builtin:tiny_qwen36"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"raypipe check-drafter: {directory} with target {targets['qwen36'].path}"
    assert lines[1].split() == ["item", "field", "trained", "vLLM", "result"]
    [dims] = [line for line in lines if line.startswith("rotary") and "rotated dims" in line]
    assert dims.split()[-1] == "FAIL" and "32 of 32" in dims and "8 of 32" in dims
    assert "vLLM will rotate 8 (head_dim 32 x partial_rotary_factor 0.25)" in out
    assert lines[-1] == "15 checks, 1 failed"  # without export.json the ids served in training are unknown


@pytest.mark.integration
def test_the_evaluation_stops_before_vllm_loads_a_drafter_that_breaks_the_contract(
    ray_cluster: str, drafters: dict[str, Path], targets: dict[str, Target], tmp_path: Path
) -> None:
    """The real evaluation on the session's cluster: the engine process checks the export and the driver stops with
    the named mismatch, instead of reporting a refusal and measuring τ on the offline replay."""
    from raypipe.eval.evaluate import run_evaluation

    cfg = load_config("debug_cpu", [f"train.output={tmp_path / 'train'}", "eval.num_prompts=2"])
    export = Path(RunFolders.of(cfg).export.url)  # where the evaluation reads the run's drafter
    export_checkpoint(cfg, _checkpoint(drafters["qwen3"], tmp_path / "ckpt", targets["qwen3"]), str(export))
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "sliding_window_non_causal": False}))
    with pytest.raises(ContractError, match=r"sliding_window_non_causal=false: per draft layer") as stopped:
        run_evaluation(cfg)
    assert f"the drafter at {export} does not match" in str(stopped.value)
    assert not Path(RunFolders.of(cfg).eval.url).exists()  # no eval.json, no plots
