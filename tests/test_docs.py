"""The documentation is self-contained: README.md and docs/ link only to files of the repository
(and to anchors that exist), never to the project's private notes."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path):
    return {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page):
    text = page.read_text()
    assert not re.search(r"SPEC\.md|DESIGN\.md|\.\./shared", text), "points to notes that are not in the repository"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_relative_to(ROOT) and linked.exists(), f"{target}: no such file in the repository"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{target}: no heading with that anchor"


def test_slug():
    assert slug("1.3 ADEPT Stage 2: unit importance and per-unit learning rates") == \
        "13-adept-stage-2-unit-importance-and-per-unit-learning-rates"
