"""Stores written before a format change still restore bit for bit.

``tests/fixtures/store_v1`` was written by ckptflow before restore checked chunks with a
fast checksum (codec "auto", 2 KiB chunks: a full at step 1, an incremental at step 2),
and holds a raw, zstd and delta chunk. Its chunks carry no checksum of the new kind, so
every read there must fall back to the sha256 address, and still reject damage.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, NoValidCheckpointError, catalog, codecs
from ckptflow import format as fmt
from ckptflow.store import open_store
from support.corrupt import flip_byte
from support.states import assert_tensors_equal, blank_like

FIXTURE = Path(__file__).parent / "fixtures" / "store_v1"
RUN = "fixture"


def fixture_state(step: int) -> dict:
    """Exactly what the fixture's step ``step`` holds (how it was generated)."""
    i = torch.arange(1024, dtype=torch.float32)
    noise = bytearray(b"".join(hashlib.sha256(f"{step}-{k}".encode()).digest() for k in range(64)))
    return {
        "model": {
            "w": torch.sin(i * 0.37) * 0.02 + torch.cos(i * 1.3) * 1e-5 * step,
            "frozen": torch.arange(512, dtype=torch.float32),
            "noise": torch.frombuffer(noise, dtype=torch.uint8),
        },
        "step": step,
    }


@pytest.fixture
def old_store(tmp_path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(FIXTURE, root)  # restore writes a recovery record: never into the checked-in copy
    return root


def _codecs(root: Path, step: int) -> dict[str, str]:
    store = open_store(str(root))
    manifest = catalog.read_manifest(store, RUN, step)
    return {d: codecs.header_codec(store.get(fmt.chunk_key(d))) for d in manifest.chunks}


def test_the_fixture_holds_every_kind_of_chunk(old_store):
    assert set(_codecs(old_store, 2).values()) == {"raw", "zstd", "delta"}


@pytest.mark.parametrize("step", [1, 2])
def test_a_store_written_before_restores_exactly(old_store, step):
    target = blank_like(fixture_state(step))
    with Checkpointer(str(old_store), RUN) as ck:
        assert ck.verify(step).ok
        assert ck.restore(target, step=step).step == step
    assert_tensors_equal(
        {k: v for k, v in fixture_state(step).items() if k != "step"}, {k: v for k, v in target.items() if k != "step"}
    )


@pytest.mark.parametrize("codec", ["raw", "zstd", "delta"])
def test_damage_in_an_old_chunk_is_still_refused(old_store, codec):
    digest = next(d for d, c in _codecs(old_store, 2).items() if c == codec)
    flip_byte(old_store / fmt.chunk_key(digest), -3)
    with Checkpointer(str(old_store), RUN) as ck, pytest.raises(NoValidCheckpointError):
        ck.restore(blank_like(fixture_state(2)), step=2)
