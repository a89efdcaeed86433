"""mkdocs hook: links from a docs page to files outside docs/ (benchmark results, source files)
work when the Markdown is read in the repository but have no page on the built site. Render them
as the repository path in code, so `mkdocs build --strict` can fail on every other broken link;
tests/test_docs_links.py checks that those repository paths exist."""

from __future__ import annotations

import posixpath
import re

_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def outside(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:", target):
            return m.group(0)
        path = posixpath.normpath(posixpath.join(here, target))
        if not path.startswith("../"):
            return m.group(0)
        repo_path = path[3:]
        text = m.group(1)
        return text if text.strip("`") == repo_path else f"{text} (`{repo_path}`)"

    return _LINK.sub(outside, markdown)
