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


TEST_REFERENCE = re.compile(r"(?<![\w/])(?:tests/)?(test_\w+\.py)(?:::(test_\w+))?")


def missing_tests(text: str) -> list[str]:
    """``test_x.py`` and ``test_x.py::test_name`` references that name no file of tests/
    or no test function in it (``test_join_*`` names a prefix)."""
    bad = []
    for found in TEST_REFERENCE.finditer(text):
        path = Path(ROOT, "tests", found.group(1))
        if not path.exists():
            bad.append(f"{found.group(0)}: no such file")
        elif found.group(2) and not re.search(rf"def {found.group(2)}", path.read_text()):
            bad.append(f"{found.group(0)}: no such test")
    return bad


DOC_PAGES = [p for p in PAGES if p.parent.name != "benchmarks"]  # RESULTS.md cites history


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(p.relative_to(ROOT)) for p in DOC_PAGES])
def test_every_test_a_page_cites_exists(page):
    assert missing_tests(page.read_text()) == []


def test_the_test_check_sees_a_renamed_test():
    assert missing_tests("`test_cli.py::test_verify_lists_only_options_it_uses`, "
                         "`tests/test_ddp.py::test_join_*`") == []
    assert missing_tests("`test_cli.py::test_gone` and tests/test_gone.py") == [
        "test_cli.py::test_gone: no such test", "tests/test_gone.py: no such file"]
