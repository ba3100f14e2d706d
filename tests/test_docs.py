"""The reference pages under docs/ are the ones the code generates; every link of the docs stays in the repository."""

import re
from pathlib import Path

from raypipe.docs import pages

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)|`(\.\.?/[^`\s]+)`")  # a link's target, or a relative path in a code span


def test_the_generated_reference_pages_are_current() -> None:
    for name, text in pages().items():
        page = ROOT / "docs" / name
        assert page.is_file() and page.read_text() == text, f"docs/{name} is stale: run `python -m raypipe.docs`"


def test_every_link_of_the_readme_and_docs_leads_to_a_file_of_the_repository() -> None:
    broken = []
    for doc in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in (a or b for a, b in LINK.findall(doc.read_text())):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
