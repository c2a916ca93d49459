"""The README and the pages under docs/ say what is true: every Python block in them runs as
written, each in a fresh process and directory; every relative link reaches a file (and a
heading, where it names one); the README stays a landing page (at most 200 lines) that links
every page of docs/.

A block that cannot run here says so in an HTML comment on the line before it
(``<!-- not run: why -->``); every other block must run and exit 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = [*PAGES, REPO / "benchmarks" / "README.md"]  # pages whose links must resolve
README_MAX_LINES = 200
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")
FRAMEWORKS = re.compile(r"^\s*(?:import|from) (?:pytorch_lightning|lightning|transformers)\b", re.M)  # slow blocks
HEADING = re.compile(r"^#{1,6} +(?P<title>.+?) *$", re.M)


def name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def blocks() -> list[tuple[str, int, str, str | None]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        found += [(name(page), text[: m.start()].count("\n") + 1, m["code"], m["why"]) for m in BLOCK.finditer(text)]
    return found


def anchors(text: str) -> set[str]:
    """The fragment ids GitHub gives the headings of a page (a repeated heading: -1, -2, ...)."""
    ids: set[str] = set()
    counts: dict[str, int] = {}
    for m in HEADING.finditer(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", m["title"].lower()).replace(" ", "-")
        counts[slug] = counts.get(slug, -1) + 1
        ids.add(slug if counts[slug] == 0 else f"{slug}-{counts[slug]}")
    return ids


def broken_links(page: Path, text: str) -> list[str]:
    """Each relative link of ``text`` (outside code) that names no file of the repository, or
    no heading of the page it names."""
    broken = []
    for m in LINK.finditer(CODE_SPAN.sub("", FENCE.sub("", text))):
        target = m["target"]
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:: not this repository's
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(REPO) or not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: no such heading in {name(file)}")
    return broken


def test_the_pages_have_runnable_blocks_and_say_why_of_the_others():
    found = blocks()
    assert {page for page, *_ in found} >= {"README.md"}
    assert any(why is None for *_, why in found)
    assert all(why is None or len(why) > 10 for *_, why in found)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page, line, code, why",
    [
        pytest.param(*block, marks=pytest.mark.slow) if FRAMEWORKS.search(block[2]) else block  # make test-e2e
        for block in blocks()
    ],
    ids=[f"{page}:{line}" for page, line, _, _ in blocks()],
)
def test_a_block_runs_as_written(tmp_path, page, line, code, why):
    if why is not None:
        pytest.skip(f"{page} line {line}: {why}")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                         env=child_env(REPO))  # fmt: skip
    assert run.returncode == 0, f"{page} block at line {line} failed:\n{run.stderr[-3000:]}"


@pytest.mark.parametrize("page", LINKED, ids=name)
def test_every_relative_link_resolves(page):
    assert broken_links(page, page.read_text()) == []


def test_a_broken_link_or_heading_is_caught():
    text = "[a](docs/storage.md) [b](docs/nothing.md) [c](docs/storage.md#no-such-heading) `[d](gone.md)`"
    assert broken_links(REPO / "README.md", text) == [
        "docs/nothing.md: no such file",
        "docs/storage.md#no-such-heading: no such heading in docs/storage.md",
    ]


def test_the_readme_is_a_landing_page_that_reaches_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= README_MAX_LINES
    linked = {(REPO / m["target"].partition("#")[0]).resolve() for m in LINK.finditer(readme)}
    assert [name(page) for page in PAGES[1:] if page not in linked] == []
