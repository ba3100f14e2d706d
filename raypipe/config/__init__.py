"""The one typed config of a raypipe run: a root model made of stage sub-configs.

A run is described by a YAML recipe (a file, or the name of one shipped in
`raypipe/recipes/`) plus `key=value` overrides. Everything is validated before
any work starts, and errors name the field and what it accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from raypipe.config.base import (
    CONTENT,
    EXECUTION,
    LOSSES,
    REDACTED,
    _Strict,
    content_dump,
    content_fields,
    fingerprint,
    redact,
    role,
)
from raypipe.config.data import DataConfig, SourceConfig
from raypipe.config.eval import EvalConfig
from raypipe.config.serve import ServeConfig
from raypipe.config.train import TrainConfig, trained_settings

__all__ = [
    "CONTENT",
    "EXECUTION",
    "LOSSES",
    "RECIPES_DIR",
    "REDACTED",
    "DataConfig",
    "EvalConfig",
    "RaypipeConfig",
    "ServeConfig",
    "SourceConfig",
    "TrainConfig",
    "content_dump",
    "content_fields",
    "fingerprint",
    "load_config",
    "parse_overrides",
    "redact",
    "role",
    "trained_settings",
]

RECIPES_DIR = Path(__file__).parent.parent / "recipes"


class RaypipeConfig(_Strict):
    """Root config of one run."""

    name: str = Field(description="Run name, used in logs and metrics.")
    data: DataConfig
    serve: ServeConfig
    train: TrainConfig
    eval: EvalConfig

    @model_validator(mode="after")
    def _consistent(self) -> RaypipeConfig:
        if self.data.max_length > self.train.schedule.step_tokens:
            raise ValueError(
                f"train.schedule.step_tokens ({self.train.schedule.step_tokens}) must hold the longest row, "
                f"data.max_length ({self.data.max_length})"
            )
        if self.data.max_length >= self.serve.max_model_len:
            raise ValueError(
                f"serve.max_model_len ({self.serve.max_model_len}) must exceed data.max_length "
                f"({self.data.max_length}): rows of up to data.max_length tokens go to vLLM for their hidden "
                "states, and vLLM refuses a prompt that leaves no room for one generated token. Set "
                f"serve.max_model_len={self.data.max_length + 1} or more (the shipped recipes give it "
                "data.max_length + 1024, room for the evaluation's replies too)"
            )
        if self.train.states.mode != "online" and not self.train.states.cache:
            raise ValueError(f"train.states.cache: give a cache URL for train.states.mode={self.train.states.mode}")
        return self


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.0.c` in nested dicts/lists, creating dicts where a key is missing."""
    keys = dotted.split(".")
    node: Any = tree
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ValueError(
                    f"override {dotted!r}: {'.'.join(keys[:i]) or 'root'} is a list of {len(node)}, {key!r} is not an "
                    "index in it"
                )
            key = int(key)
        elif not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {'.'.join(keys[:i])} is not a section")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and key not in node:
                node[key] = {}
            node = node[key]


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key=value` pairs; values are YAML so `data.max_length=4096` is an int."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value, e.g. data.max_length=4096")
        pairs.append((key.strip(), _override_value(item, raw)))
    return pairs


def _override_value(item: str, raw: str) -> Any:
    """The override's value as YAML, or one line naming the override and YAML's complaint."""
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(
            f"override {item!r} is not valid YAML ({problem}); quote it for the shell and complete it, e.g. "
            "'data.sources=[{path: data/x.jsonl}]'"
        ) from None


def recipe_path(recipe: str) -> Path:
    """A recipe is a YAML file path or the name of a shipped recipe."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    shipped = RECIPES_DIR / f"{recipe}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ValueError(f"unknown recipe {recipe!r}: give a .yaml file or one of {', '.join(names)}")


def load_config(recipe: str, overrides: list[str] = ()) -> RaypipeConfig:
    """Recipe + overrides -> validated config; a ValueError names every bad field."""
    path = recipe_path(recipe)
    tree = yaml.safe_load(path.read_text()) or {}
    for key, value in parse_overrides(list(overrides)):
        _set_path(tree, key, value)
    try:
        return RaypipeConfig.model_validate(tree)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"]) or "root"
            got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
            lines.append(f"  {field}: {e['msg']}{got}")
        raise ValueError(f"invalid config from {path.name}:\n" + "\n".join(lines)) from None
