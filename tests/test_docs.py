"""The documentation is self-contained: README.md and docs/ link only to files of the repository
(and to anchors that exist), never to the project's private notes. The README is a front door:
small, undated, and it links to every page of docs/."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_BYTES = 15_000
# Wording that dates the README or reads like a log: results pages carry their own dates.
DATED = re.compile(r"\blatest\b|\bthis session\b|\bre-?checked\b|\b(?:19|20)\d\d-\d\d-\d\d\b", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def without_code(text: str) -> str:
    """The Markdown outside fenced code blocks (a `# comment` in a bash block is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path):
    return {slug(h) for h in re.findall(r"^#+ (.*)$", without_code(page.read_text()), flags=re.M)}


def links(text: str):
    """The targets of the Markdown links and images of `text`, outside code blocks."""
    return re.findall(r"\]\(([^)\s]+)\)", without_code(text))


def broken_links(page: Path):
    """'target: why' for every relative link of `page` that does not resolve inside the repository."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not (linked.is_relative_to(ROOT) and linked.exists()):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page):
    text = page.read_text()
    assert not re.search(r"SPEC\.md|DESIGN\.md|\.\./shared", text), "points to notes that are not in the repository"
    assert broken_links(page) == []


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move details to docs/ (limit {README_MAX_BYTES})"
    dated = sorted({m.group(0) for m in DATED.finditer(README.read_text())})
    assert not dated, f"README.md has dated or log-like wording {dated}: dates belong on the results pages"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README.read_text())}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_slug():
    assert slug("1.3 ADEPT Stage 2: unit importance and per-unit learning rates") == \
        "13-adept-stage-2-unit-importance-and-per-unit-learning-rates"
    assert slug("With transformers.Trainer") == "with-transformerstrainer"


def test_the_checks_catch_planted_faults(tmp_path, monkeypatch):
    """Each check fails on a page that breaks it (so a passing run means something)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some section\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#some-section) [web](https://example.org) [self](#top)\n# Top\n"
                    "[gone](docs/missing.md) [bad anchor](docs/a.md#no-such-section) "
                    "[code comment](docs/a.md#not-a-heading) [outside](../../etc/passwd)\n"
                    "```bash\n[in code](nowhere.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page)] == [
        "docs/missing.md", "docs/a.md#no-such-section", "docs/a.md#not-a-heading", "../../etc/passwd"]
    for words in ("measured in the latest session", "Re-checked on", "this session", "on 2026-12-02"):
        assert DATED.search(words), words
    for words in ("the last layer", "2 × 128 tokens", "a date-free page", "checked"):
        assert not DATED.search(words), words


def test_the_cli_option_tables_are_the_declarations():
    """docs/cli.md's option tables are generated from the options' one declaration (the runners'
    fields and the methods' config fields): `python tools/write_cli_docs.py` after changing one."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import write_cli_docs
    finally:
        sys.path.remove(str(ROOT / "tools"))
    text = (ROOT / "docs" / "cli.md").read_text()
    assert write_cli_docs.BLOCK.findall(text), "docs/cli.md has no generated option table"
    assert write_cli_docs.written(text) == text, "docs/cli.md is out of date: run python tools/write_cli_docs.py"
