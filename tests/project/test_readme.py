"""The README's Python blocks run as written, each in a fresh process and directory.

A block that cannot run here says so in an HTML comment on the line before it
(``<!-- not run: why -->``); every other block must run and exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks() -> list[tuple[int, str, str | None]]:
    text = (REPO / "README.md").read_text()
    return [(text[: m.start()].count("\n") + 1, m["code"], m["why"]) for m in BLOCK.finditer(text)]


def test_the_readme_has_runnable_blocks_and_says_why_of_the_others():
    found = blocks()
    assert any(why is None for _, _, why in found)
    assert all(why is None or len(why) > 10 for _, _, why in found)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line, code, why", blocks(), ids=[f"line-{line}" for line, _, _ in blocks()])
def test_a_readme_block_runs_as_written(tmp_path, line, code, why):
    if why is not None:
        pytest.skip(f"README line {line}: {why}")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert run.returncode == 0, f"README block at line {line} failed:\n{run.stderr[-3000:]}"
