"""README blocks generated from the code, so the reference cannot drift: the config fields and the metrics.

`python -m raypipe.docs` rewrites the blocks between `<!-- NAME:start -->` and
`<!-- NAME:end -->` in README.md; a test fails when they are stale.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raypipe.config import DataConfig, EvalConfig, ServeConfig, SourceConfig, TrainConfig
from raypipe.dashboard import PANELS

SECTIONS = (
    ("data", DataConfig),
    ("data.sources[]", SourceConfig),
    ("serve", ServeConfig),
    ("train", TrainConfig),
    ("eval", EvalConfig),
)


def _default(field: object) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return "none" if value is None or value is PydanticUndefined else f"`{json.dumps(value)}`"


def config_reference() -> str:
    lines = []
    for prefix, model in SECTIONS:
        lines += [f"**`{prefix}`**", "", "| field | default | meaning |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                continue
            lines.append(f"| `{name}` | {_default(field)} | {(field.description or '').replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def metrics_table() -> str:
    lines = ["| stage | panel | query (Prometheus) | meaning |", "|---|---|---|---|"]
    for p in PANELS:
        lines.append(f"| {p.stage} | {p.title} | `{p.expr.replace('|', '/')}` | {p.description} |")
    return "\n".join(lines)


BLOCKS = {"config-reference": config_reference, "metrics": metrics_table}


def render(readme: str) -> str:
    for name, build in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"README.md has no <!-- {name}:start --> ... <!-- {name}:end --> block")
        readme = pattern.sub(lambda m, b=build: m.group(1) + b() + "\n" + m.group(2), readme)
    return readme


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    path.write_text(render(path.read_text()))
