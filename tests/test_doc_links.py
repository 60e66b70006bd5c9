"""Links between the project's Markdown pages lead somewhere: every relative link of
README.md, docs/*.md and benchmarks/*.md names a file that exists, and a ``#anchor``
names a heading of that page (GitHub's anchors) or an explicit ``<a id>``, so moving a section of
benchmarks/RESULTS.md cannot silently break the docs that cite it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = sorted([Path(ROOT, "README.md"), *Path(ROOT, "docs").glob("*.md"),
                *Path(ROOT, "benchmarks").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, markup and punctuation
    dropped (word characters, hyphens and spaces kept), spaces turned into hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = FENCE.sub("", page.read_text())
    out.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))  # explicit anchors
    for line in text.splitlines():
        found = re.match(r"#{1,6} (.+)", line)
        if found:
            slug = anchor(found.group(1))
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", t)]  # http:, mailto: ... are not checked


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_leads_to_a_file_and_a_heading(page):
    assert broken(page) == []


def test_the_check_knows_githubs_anchors_and_sees_a_broken_link(tmp_path):
    assert anchor('ZeRO-3 (`shard="parameters"`) beside the other stages') == (
        "zero-3-shardparameters-beside-the-other-stages")
    assert anchor("Under load: 14.2M MLP at W = 2, glibc's default heap") == (
        "under-load-142m-mlp-at-w--2-glibcs-default-heap")
    (tmp_path / "a.md").write_text("# Title\n\n## Same\n\n## Same\n\n<a id=\"own\"></a>\n"
                                   "[x](b.md) [y](#same-1) [z](#gone) [v](#own) "
                                   "[w](https://example.com/#x)\n")
    assert anchors(tmp_path / "a.md") == {"title", "same", "same-1", "own"}
    assert broken(tmp_path / "a.md") == ["b.md: no such file",
                                         "#gone: no heading with that anchor in a.md"]
