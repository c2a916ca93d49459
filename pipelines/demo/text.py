"""The demo's long lines (reasons, paths) wrapped at spaces, never inside a word or a path."""

from __future__ import annotations

import textwrap


def wrapped(text: str, *, indent: str = "    ") -> str:
    return textwrap.fill(
        text,
        width=100,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
