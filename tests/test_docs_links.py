"""Every relative link in README.md and docs/ resolves: the file exists and, for a Markdown
target with an anchor, the heading does. Moved pages cannot rot silently (the docs site build,
`mkdocs build --strict` in scripts/test.sh, checks the site's own pages; this covers the
README and links from docs/ to the rest of the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's (and MkDocs toc's) anchor for a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    """A check that passes on everything is broken: a made-up target must fail it."""
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](p.md#title) [bad](missing.md) [bad anchor](p.md#nope)\n")
    assert links(page) == ["p.md#title", "missing.md", "p.md#nope"]
    assert (tmp_path / "missing.md").exists() is False
    assert "nope" not in anchors(page) and "title" in anchors(page)


def test_readme_stays_short() -> None:
    """The README is the five-minute read; longer text lives in docs/ pages it links."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
