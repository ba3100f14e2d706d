from pathlib import Path

import pytest

from raypipe.config import (
    RECIPES_DIR,
    DataConfig,
    ServeConfig,
    TrainConfig,
    load_config,
    parse_overrides,
    role,
    trained_settings,
)
from raypipe.preflight import preflight, problems

ROLES = ("content", "execution")


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_shipped_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert cfg.name == recipe
    assert cfg.data.max_length < cfg.serve.max_model_len


def test_a_full_length_row_needs_room_for_one_generated_token():
    """vLLM refuses a prompt of max_model_len tokens (it generates at least one): the config says so, with the fix."""
    with pytest.raises(
        ValueError,
        match=r"serve.max_model_len \(256\) must exceed data.max_length \(256\).*"
        r"Set serve.max_model_len=257 or more",
    ):
        load_config("debug_cpu", ["data.max_length=256", "serve.max_model_len=256", "train.schedule.step_tokens=256"])
    cfg = load_config("debug_cpu", ["data.max_length=256", "serve.max_model_len=257", "train.schedule.step_tokens=256"])
    assert cfg.serve.max_model_len == cfg.data.max_length + 1


def test_overrides_are_yaml_typed_and_reach_nested_lists():
    cfg = load_config("debug_cpu", ["data.max_length=128", "data.sources.0.name=mine", "data.enable_thinking=true"])
    assert cfg.data.max_length == 128
    assert cfg.data.sources[0].name == "mine"
    assert cfg.data.enable_thinking is True


def test_invalid_values_name_the_field_and_what_is_allowed():
    with pytest.raises(ValueError) as err:
        load_config("debug_cpu", ["data.overlength=cut", "data.max_length=-1", "data.maxlen=3"])
    text = str(err.value)
    assert "data.overlength" in text and "'truncate' or 'reject'" in text and "'cut'" in text
    assert "data.max_length" in text and "greater than 0" in text
    assert "data.maxlen" in text and "Extra inputs are not permitted" in text


def test_unknown_template_and_recipe_are_explained(tmp_path):
    cfg = load_config("debug_cpu", ["data.chat_template=llama9"])  # the config is pure: no file is looked for here
    with pytest.raises(ValueError, match="data.chat_template.*qwen_strict, generation_markers, chatml"):
        preflight(cfg)  # the driver's check, once
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages }}")
    assert problems(load_config("debug_cpu", [f"data.chat_template={template}"])) == []
    with pytest.raises(ValueError, match="unknown recipe 'nope'.*debug_cpu"):
        load_config("nope")


def test_every_field_of_the_stage_configs_that_fingerprints_read_is_classified():
    """Fingerprints, the resume check and output_hash come from each field's role: a new field without one fails
    here instead of silently counting as content (a resume refused) or as execution (a changed run resumed)."""
    for model in (DataConfig, ServeConfig, TrainConfig):
        unclassified = [name for name, field in model.model_fields.items() if role(field) not in ROLES]
        assert not unclassified, f"{model.__name__}: give {unclassified} json_schema_extra=CONTENT or EXECUTION"
    trained = trained_settings(load_config("demo").model_dump())
    assert trained["train.drafter.block_size"] == 4 and trained["train.optim.lr"] == 3e-3
    assert not any(k.startswith(("train.run.", "train.states.", "train.output")) for k in trained)


def test_a_resume_may_change_how_the_run_executes_but_not_what_it_trains():
    base = trained_settings(load_config("demo").model_dump())
    moved = load_config("demo", ["train.run.num_workers=4", "train.states.mode=online", "train.output=/elsewhere"])
    assert trained_settings(moved.model_dump()) == base
    assert trained_settings(load_config("demo", ["train.optim.lr=1e-3"]).model_dump()) != base


def test_the_config_module_imports_no_component():
    """raypipe.config is the base of every stage: its modules import nothing of raypipe but each other (the import
    circle config -> trackers -> layout -> config is gone) and read no environment."""
    import ast

    import raypipe.config

    for path in Path(raypipe.config.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        outside = [m for m in imported if m and m.startswith("raypipe") and not m.startswith("raypipe.config")]
        assert not outside, (path.name, outside)
        assert "os" not in imported and "environ" not in path.read_text(), path.name


def test_bad_override_syntax():
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["data.max_length"])
    with pytest.raises(ValueError, match="list of 3"):
        load_config("debug_cpu", ["data.sources.3.path=x"])


def test_output_hash_ignores_parallelism_only():
    base = load_config("debug_cpu").data
    assert (
        base.output_hash()
        == load_config("debug_cpu", ["data.num_actors=7", "data.output=/elsewhere"]).data.output_hash()
    )
    assert base.output_hash() != load_config("debug_cpu", ["data.max_length=10"]).data.output_hash()


def test_recipe_file_path(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text((RECIPES_DIR / "debug_cpu.yaml").read_text().replace("name: debug_cpu", "name: mine"))
    assert load_config(str(path)).name == "mine"


def test_source_names():
    cfg = load_config(
        "debug_cpu", ["data.sources=[{path: s3://b/x/train.jsonl}, {path: /d/chats/*.jsonl}, {path: a, name: n}]"]
    )
    assert [s.source_name for s in cfg.data.sources] == ["train", "chats", "n"]
