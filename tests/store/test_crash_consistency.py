"""A power cut at every disk operation of a save and of a GC sweep (tests/support/crashfs.py):
afterwards the store restores the old or the new checkpoint, never a mix; a save that
returned survives; GC never loses a chunk a checkpoint references."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptflow import Checkpointer, gc, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store.local import LocalStore
from support.crashfs import RecordingDisk, durable_after, snapshot
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state


def restored(root: Path, step: int | None = None) -> tuple[int, int]:
    """(step restored, tag of the state it holds) from a fresh process's point of view."""
    with Checkpointer(str(root), run=RUN, restore_rng=False) as ck:
        state = blank_state()
        result = ck.restore(state, step=step)
    return result.step, state_tag(state)


@pytest.mark.parametrize("kind", ["full", "incremental"])
def test_a_power_cut_during_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path, kind):
    root = tmp_path / "store"
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(2))
    initial = snapshot(root)
    disk = RecordingDisk()
    with Checkpointer(LocalStore(str(root), disk=disk), run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(2, tagged_state(3), kind=kind)
    manifest = str(root / fmt.manifest_key(RUN, 2))
    linked = next(i for i, op in enumerate(disk.ops) if op[0] == "link" and op[2] == manifest)
    committed = next(
        i for i, op in enumerate(disk.ops) if i > linked and op == ("fsync_dir", os.path.dirname(manifest))
    )
    outcomes = set()
    for cut in range(len(disk.ops) + 1):
        after = tmp_path / f"cut-{cut}"
        durable_after(root, initial, disk.ops, cut, after)
        step, tag = restored(after)
        assert (step, tag) in ((1, 2), (2, 3)), f"cut after op {cut} {disk.ops[cut - 1] if cut else ''}"
        if cut > committed:  # the save had committed durably: it must survive
            assert step == 2, f"cut after op {cut}: the committed step 2 was lost"
        outcomes.add(step)
    assert outcomes == {1, 2} and len(disk.ops) > 30


def test_a_power_cut_during_a_gc_sweep_never_loses_a_referenced_chunk(tmp_path):
    root = tmp_path / "store"
    with Checkpointer(str(root), run=RUN, chunk_bytes=CHUNK) as ck:
        for step in range(1, 5):
            ck.save(step, tagged_state(step + 1), kind="full" if step % 2 else "incremental")
    store = open_store(str(root))
    for step in (1, 2):  # retention expired them: their own chunks are garbage
        store.delete(fmt.manifest_key(RUN, step))
    old = time.time() - 7200
    for path in root.rglob("*"):
        os.utime(path, (old, old), follow_symlinks=False)
    initial = snapshot(root)
    disk = RecordingDisk()
    report = gc(LocalStore(str(root), disk=disk), grace="1h")
    assert report.skipped is None and len(report.deleted) > 5
    referenced = {step: set(catalog.read_manifest(store, RUN, step).chunks) for step in (3, 4)}
    for cut in range(len(disk.ops) + 1):
        after = tmp_path / f"cut-{cut}"
        durable_after(root, initial, disk.ops, cut, after)
        for step in (3, 4):
            assert all((after / fmt.chunk_key(d)).is_file() for d in referenced[step])
            assert restored(after, step) == (step, step + 1)
