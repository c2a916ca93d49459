"""Helpers shared by test_faults.py (crashes, SIGKILL) and test_gc.py (GC safety): the run
name, the chunk size, and tagged states whose every tensor says which checkpoint it holds.
"""

from __future__ import annotations

import torch

RUN = "r"
CHUNK = 64  # bytes: every tensor below spans several chunks


def make_state(tag: int) -> dict:
    """A state whose every tensor (and the JSON leaf) identifies the checkpoint ``tag``.

    ``shared`` is identical in every tag so incremental saves dedup it; tags 0 and 1 are
    never saved (0 = empty restore target).
    """
    return {
        "model": {
            "shared": torch.arange(48, dtype=torch.float32),
            "w": torch.arange(30, dtype=torch.float32) + 1000.0 * tag,
        },
        "z": torch.linspace(-1, 1, 40, dtype=torch.float64) * tag,
        "epoch": tag,
    }


def blank_state() -> dict:
    return {
        "model": {"shared": torch.full((48,), -7.0), "w": torch.full((30,), -7.0)},
        "z": torch.full((40,), -7.0, dtype=torch.float64),
        "epoch": None,
    }


def state_tag(state: dict) -> int:
    """Which tag ``state`` holds, asserting that it is exactly one tag's state (no mix)."""
    tag = state["epoch"]
    expected = make_state(tag)
    assert torch.equal(state["model"]["shared"], expected["model"]["shared"])
    assert torch.equal(state["model"]["w"], expected["model"]["w"]), f"weights w are not those of tag {tag}"
    assert torch.equal(state["z"], expected["z"]), f"tensor z is not that of tag {tag}"
    return tag
