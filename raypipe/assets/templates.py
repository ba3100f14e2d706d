"""Chat templates written for raypipe, shipped as Jinja files beside this module."""

from importlib import resources

TEMPLATE_NAMES = ("qwen_strict", "generation_markers", "chatml")


def load_template(name: str) -> str:
    """Return the Jinja source of a built-in template, so configs can name one instead of a path."""
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown chat template {name!r}; choose one of {', '.join(TEMPLATE_NAMES)}")
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")
