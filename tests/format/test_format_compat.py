"""Stores written before a format change still restore bit for bit, and take new saves.

``tests/fixtures/store_v1`` was written by ckptflow in format 1 (chunks addressed by
sha256, no fast checksums; codec "auto", 2 KiB chunks: a full at step 1, an incremental
at step 2), and holds a raw, zstd and delta chunk. Every read there must fall back to
the sha256 address, and still reject damage. Saves into it are format 2 (BLAKE3).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, NoValidCheckpointError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.gc import gc
from ckptflow.chunks import codecs
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.corrupt import flip_byte
from support.states import assert_tensors_equal, blank_like

FIXTURE = Path(__file__).parents[1] / "fixtures" / "store_v1"
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


def test_a_format_2_save_into_an_old_run_reads_both_and_collects_nothing_live(old_store):
    """A new incremental on a format-1 full: its chunks are new BLAKE3 names (no dedup
    across the change), a delta may still use the sha256-named base, and verify --deep
    checks each manifest by its own kind of address."""
    state = fixture_state(3)
    with Checkpointer(str(old_store), RUN, codec="auto", chunk_bytes=2048) as ck:
        ck.save(3, state, kind="incremental")
        store = open_store(str(old_store))
        old, new = catalog.read_manifest(store, RUN, 2), catalog.read_manifest(store, RUN, 3)
        assert (old.address, new.address) == ("sha256", "blake3")
        assert not set(old.chunks) - set(old.bases.values()) & set(new.chunks) - set(new.bases.values())
        for step in (1, 2, 3):
            assert ck.verify(step, deep=True).ok and ck.verify(step).ok
        gc(store, grace=0)
        assert set(new.bases.values()) & set(old.chunks)  # deltas on sha256-named bases
        for step in (1, 2, 3):
            target = blank_like(fixture_state(step))
            assert ck.restore(target, step=step).step == step
            assert_tensors_equal(
                {k: v for k, v in fixture_state(step).items() if k != "step"},
                {k: v for k, v in target.items() if k != "step"},
            )
    assert fmt.FORMAT_VERSION == 2 and b'"format_version":2' in (old_store / fmt.manifest_key(RUN, 3)).read_bytes()
