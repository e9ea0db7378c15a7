"""The documentation: README.md is a front door (about 12 KB, with the two commands), and every
relative link in README.md, docs/*.md, benchmarks/README.md and CHANGELOG.md reaches a file that
exists, and, where it names an anchor in a Markdown file, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md", ROOT / "CHANGELOG.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks (whose brackets are code, not links)."""
    return FENCE.sub("", text)


def links(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    # a code span can hold a link's text ([`x`](y)) but never a link, so only bracket-free spans go
    text = CODE_SPAN.sub(lambda m: m.group(0) if "](" not in m.group(0) else "", text)
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    # About 12 KB: the bound leaves a margin, so that a line added does not fight the cap; past it
    # detail moves to docs/.
    assert size <= 13_000, f"README.md is {size} bytes; move detail to docs/ (it is about 12 KB, at most 13000 bytes)"


def test_readme_names_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "bash scripts/train.sh" in text
    assert "bash scripts/test.sh" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), page
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_links_and_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A `b` — c\n\n[x](q.md#y) ![i](img.png) [`k`](r.md)\n```\n[no](code.md)\n```\n")
    assert links(page) == ["q.md#y", "img.png", "r.md"]
    assert anchors(page) == {"a-b--c"}
