"""A state written by another thread while a blocking save reads it.

The checkpoint may mix values from before and after the write (as DCP's can), but every
chunk it commits must hold the bytes its manifest names: verify passes and restore loads
it, never falls back from it (``ckptflow.chunks.private_copies``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from ckptflow.chunks import codecs
from ckptflow.dcp import writer as writer_module


def _before_each_encoding(monkeypatch, action):
    """Run ``action`` as each chunk a save writes is encoded, before it is stored."""
    real = codecs.encode

    def encoding(*args, **kwargs):
        action()
        return real(*args, **kwargs)

    monkeypatch.setattr(codecs, "encode", encoding)


@pytest.mark.parametrize("kind", ["full", "incremental"])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_write_while_a_chunk_is_stored_changes_neither_the_chunk_nor_its_address(
    make_ck, store_url, monkeypatch, kind, codec
):
    ck = make_ck(root=store_url, codec=codec, track_writes=False, pack_bytes=0)  # packs: test_packs_*
    state = {"w": torch.arange(4096, dtype=torch.float32)}  # one chunk
    ck.save(1, state, rng=False)
    state["w"] += 1  # step 2 has new bytes, so its chunk is written
    before = state["w"].clone()
    _before_each_encoding(monkeypatch, lambda: state["w"].mul_(-1))
    ck.save(2, state, kind=kind, rng=False)
    monkeypatch.undo()
    assert ck.verify(2, deep=True).ok
    fresh = {"w": torch.zeros(4096)}
    assert make_ck(root=store_url).restore(fresh).step == 2
    assert torch.equal(fresh["w"], before)  # what was copied before the write


def test_a_write_between_the_change_check_and_the_copy_is_stored_under_its_own_address(make_ck, monkeypatch):
    """An incremental save finds the region as its previous save stored it (xxh3), but that
    chunk has gone from the store, so it is written anew; the owner writes the region
    before it is copied: the chunk is stored as copied, addressed anew."""
    ck = make_ck(track_writes=False, pack_bytes=0)
    state = {"w": torch.randn(4096)}
    ck.save(1, state, rng=False)
    for chunk in list(ck.store.list("chunks/")):
        ck.store.delete(chunk.key)  # gone since (a sweep, a user): the reused chunk must be written again
    real, written = writer_module.same_content, []

    def then_written(raw, checksum):
        same = real(raw, checksum)
        if same and not written:
            state["w"].add_(1.0)
            written.append(True)
        return same

    monkeypatch.setattr(writer_module, "same_content", then_written)
    ck.save(2, state, kind="incremental", rng=False)
    assert written
    assert ck.verify(2, deep=True).ok
    fresh = {"w": torch.zeros(4096)}
    assert make_ck().restore(fresh).step == 2
    assert torch.equal(fresh["w"], state["w"])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_reused_chunk_gone_from_the_store_is_written_again_from_a_copy(make_ck, monkeypatch, codec):
    """An incremental save reuses an unchanged region's chunk, finds it gone, and writes it
    again: from a private copy too, so a write while it is encoded does not reach it."""
    ck = make_ck(track_writes=False, codec=codec, pack_bytes=0)
    state = {"w": torch.randn(4096)}
    ck.save(1, state, rng=False)
    for chunk in list(ck.store.list("chunks/")):
        ck.store.delete(chunk.key)
    before = state["w"].clone()
    _before_each_encoding(monkeypatch, lambda: state["w"].mul_(-1))
    ck.save(2, state, kind="incremental", rng=False)
    monkeypatch.undo()
    assert ck.verify(2, deep=True).ok
    fresh = {"w": torch.zeros(4096)}
    assert make_ck().restore(fresh).step == 2
    assert torch.equal(fresh["w"], before)


def test_a_full_save_of_a_changed_region_addresses_it_by_its_new_bytes(make_ck):
    """A full save takes the previous save's address for a region only where the copy it
    writes has the previous checksum: the region changed, so it is addressed anew."""
    ck = make_ck(track_writes=False, pack_bytes=0)
    state = {"w": torch.randn(4096), "same": torch.randn(4096)}
    ck.save(1, state, rng=False)
    state["w"].add_(1.0)
    ck.save(2, state, kind="full", rng=False)
    assert ck.verify(2, deep=True).ok
    fresh = {"w": torch.zeros(4096), "same": torch.zeros(4096)}
    assert make_ck().restore(fresh).step == 2
    assert torch.equal(fresh["w"], state["w"]) and torch.equal(fresh["same"], state["same"])
    assert len(list(ck.store.list("chunks/"))) == 3  # "w" before and after, "same" once


@pytest.mark.parametrize("track_writes", [True, False])
def test_saves_while_a_thread_trains_commit_only_checkpoints_that_verify(make_ck, track_writes):
    ck = make_ck(chunk_bytes=64 << 10, track_writes=track_writes)
    state = {f"w{i}": torch.randn(1 << 16) for i in range(4)}  # 4 x 256 KiB, 4 chunks each
    state |= {f"b{i}": torch.randn(256) for i in range(40)}  # 1 KiB each: packed, 16 to a pack
    stop = threading.Event()

    def train():
        while not stop.is_set():
            for tensor in state.values():
                tensor.add_(1e-3)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        for step in range(1, 9):
            ck.save(step, state, kind="full" if step % 4 == 1 else "incremental", rng=False)
    finally:
        stop.set()
        trainer.join()
    assert [step for step in range(1, 9) if not ck.verify(step, deep=True).ok] == []
    ck.save(9, state, kind="incremental", rng=False)  # the last save holds what the state is now
    fresh = {name: torch.zeros_like(t) for name, t in state.items()}
    assert make_ck().restore(fresh).step == 9
    assert all(torch.equal(fresh[name], t) for name, t in state.items())


@pytest.mark.parametrize("kind", ["full", "incremental"])
def test_packs_a_write_after_a_pack_is_copied_is_not_in_it_and_its_address_holds(make_ck, monkeypatch, kind):
    """A pack is hashed and stored from the copy its members were copied into: a write to a
    member right after the copy leaves the checkpoint with the value copied, verified."""
    from ckptflow.dcp import packs

    ck = make_ck(track_writes=False)
    model = {f"b{i}": torch.randn(256) for i in range(8)}  # one pack
    ck.save(1, {"model": model}, rng=False)
    model["b3"].add_(1.0)
    saved = {name: t.clone() for name, t in model.items()}
    real = packs.Pack.fill

    def then_written(self, out):
        real(self, out)
        model["b3"].add_(1.0)  # the owner goes on writing

    monkeypatch.setattr(packs.Pack, "fill", then_written)
    ck.save(2, {"model": model}, kind=kind, rng=False)
    assert ck.verify(2, deep=True).ok
    fresh = {name: torch.zeros(256) for name in model}
    assert make_ck().restore({"model": fresh}).step == 2
    assert all(torch.equal(fresh[name], saved[name]) for name in model)
    assert not torch.equal(model["b3"], saved["b3"])  # written after the copy
