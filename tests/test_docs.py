"""The README's config reference and metric table are the ones the code generates."""

from pathlib import Path

from raypipe.docs import render

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_generated_readme_blocks_are_current() -> None:
    text = README.read_text()
    assert render(text) == text, "regenerate with `python -m raypipe.docs`"
