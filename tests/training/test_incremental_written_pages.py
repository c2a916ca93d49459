"""Incremental saves skip reading tensors whose pages no write reached since the previous
save (``ckptflow.dcp.written_pages``), and stay exact when a save fails in between, when
tracking is off, and when a full save finds the kernel's word wrong."""

import ctypes
import logging
import threading

import pytest
import torch

from ckptflow.dcp import writer, written_pages
from ckptflow.dcp.written_pages import WriteTracker

MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    WriteTracker.open() is None, reason="this kernel cannot track page writes (Linux 6.7+ userfaultfd WP_ASYNC)"
)


@pytest.fixture
def read(monkeypatch) -> list[int]:
    """The lengths of the regions a save reads to compare with its previous save's."""
    lengths: list[int] = []
    real = writer.same_content

    def counting(raw, checksum):
        lengths.append(len(raw))
        return real(raw, checksum)

    monkeypatch.setattr(writer, "same_content", counting)
    return lengths


def _state() -> dict:
    torch.manual_seed(0)
    return {"frozen": torch.randn(2 * MiB), "adapter": torch.randn(MiB // 4)}  # 8 MiB and 1 MiB


def _restored(make_ck, step: int) -> dict:
    fresh = {"frozen": torch.zeros(2 * MiB), "adapter": torch.zeros(MiB // 4)}
    make_ck(chunk_bytes=MiB).restore(fresh, step=step)
    return fresh


def _assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_untouched_regions_cost_the_pool_no_task(make_ck, monkeypatch):
    """A region no write reached needs no read and no write, only its chunk touched: the
    saving thread does that itself, and the pool's threads get only what must be read."""
    state = _state()
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    state["adapter"].add_(1e-3)
    puts: list[str] = []  # the threads each chunk of the save was put on
    real_put = writer.CheckpointWriter._put

    def recording(self, piece, tensor, encoder, region, *args):
        puts.append(threading.current_thread().name)
        return real_put(self, piece, tensor, encoder, region, *args)

    monkeypatch.setattr(writer.CheckpointWriter, "_put", recording)
    info = ck.save(2, state, kind="incremental", rng=False).info
    assert info.bytes_unread == 8 * MiB
    assert puts.count("MainThread") == 8  # the backbone's eight chunks, touched by the saving thread
    on_pool = [name for name in puts if name != "MainThread"]
    assert len(on_pool) == 1 and on_pool[0].startswith("ckptflow")  # the adapter's one chunk, read on the pool
    assert _restored(make_ck, 2)["adapter"].equal(state["adapter"])


def test_an_incremental_save_reads_only_the_tensors_written_since_the_previous_save(make_ck, read):
    state = _state()
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    state["adapter"].add_(1e-3)  # a LoRA step: the backbone is frozen
    read.clear()
    info = ck.save(2, state, kind="incremental", rng=False).info
    assert read == [MiB]  # the adapter's one chunk; not one of the backbone's eight
    assert info.bytes_written == MiB and info.bytes_unread == 8 * MiB  # the manifest says what was skipped
    read.clear()
    ck.save(3, state, kind="incremental", rng=False)
    assert read == [MiB]  # nothing written since; the adapter, written all over before, is left unprotected a while
    _assert_equal(_restored(make_ck, 3), state)


def test_track_writes_false_reads_every_region(make_ck, read):
    state = _state()
    ck = make_ck(chunk_bytes=MiB, track_writes=False)
    ck.save(1, state, kind="full", rng=False)
    read.clear()
    info = ck.save(2, state, kind="incremental", rng=False).info
    assert len(read) == 9 and info.bytes_unread == 0


def test_a_save_that_failed_after_its_snapshot_vouches_for_nothing_read_before_it(make_ck, monkeypatch):
    """Save 2 protects the pages again, then fails: the Checkpointer still holds save 1's
    record. A write between save 1 and save 2 left its pages unprotected until save 2's
    snapshot, which the kernel no longer reports to save 3: save 3 must read those regions."""
    state = _state()
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    state["frozen"][100_000] = 42.0  # inside its first region, not in an edge page
    real = writer.ChunkStore.put
    monkeypatch.setattr(writer.ChunkStore, "put", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(Exception, match="disk gone"):
        ck.save(2, state, kind="incremental", rng=False)
    monkeypatch.setattr(writer.ChunkStore, "put", real)
    ck.save(3, state, kind="incremental", rng=False)
    _assert_equal(_restored(make_ck, 3), state)


def test_a_full_save_that_finds_vouched_bytes_changed_stops_tracking(make_ck, monkeypatch, caplog, read):
    """A full save reads every byte: if the kernel vouched for a region whose bytes changed
    (a device writing by DMA into memory it pinned by other means), tracking is wrong for this
    process: it is switched off and said so, and the checkpoint holds the new bytes."""
    state = _state()
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    monkeypatch.setattr(written_pages.Snapshot, "unwritten", lambda *a: True)  # the kernel's word, wrong
    state["frozen"][100_000] = 42.0  # inside its first region, not in an edge page
    with caplog.at_level(logging.WARNING, logger=written_pages.__name__):
        ck.save(2, state, kind="full", rng=False)
    assert "stop trusting page write tracking" in caplog.text
    _assert_equal(_restored(make_ck, 2), state)
    state["frozen"][100_001] = 43.0
    read.clear()
    ck.save(3, state, kind="incremental", rng=False)
    assert len(read) == 9  # every region read again
    _assert_equal(_restored(make_ck, 3), state)


def test_a_layer_trained_then_frozen_is_read_while_trained_and_skipped_again_once_frozen(make_ck, read):
    state = _state()  # "frozen" is not, here
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    for step in range(2, 6):  # trained every interval: left unprotected after the first, read each time
        state["frozen"].add_(1e-3)
        read.clear()
        ck.save(step, state, kind="incremental", rng=False)
        assert len(read) == 8  # its 8 chunks; never the unchanged adapter's
        _assert_equal(_restored(make_ck, step), state)
    skipped_at = None
    for step in range(6, 6 + written_pages.REST_SAVES + 2):  # frozen from now on
        read.clear()
        ck.save(step, state, kind="incremental", rng=False)
        if not read:
            skipped_at = step
            break
    assert skipped_at is not None
    _assert_equal(_restored(make_ck, skipped_at), state)


def test_a_tensor_mapped_from_a_file_that_is_rewritten_is_read_again(make_ck, tmp_path):
    """``torch.load(mmap=True)`` (or safetensors, ``np.memmap``): the live tensor shows what the
    file holds, and rewriting the file changes it without a write through this process's
    page tables. Such pages are never vouched for."""
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.full((MiB,), 1.0)}, path)
    state = {"w": torch.load(path, mmap=True, weights_only=True)["w"]}
    ck = make_ck(chunk_bytes=MiB)
    ck.save(1, state, kind="full", rng=False)
    torch.save({"w": torch.full((MiB,), 2.0)}, path)  # the same file, rewritten in place
    assert state["w"][0] == 2.0
    ck.save(2, state, kind="incremental", rng=False)
    fresh = {"w": torch.zeros(MiB)}
    make_ck().restore(fresh, step=2)
    assert torch.equal(fresh["w"], state["w"])


def _writing_during_the_save(monkeypatch, tensor: torch.Tensor, index: int, value: float) -> None:
    """The next save's first chunk of ``tensor`` is written, then ``tensor[index] = value``
    lands, as from a thread still training: after the bytes were read, before the save ends."""
    real = writer.ChunkStore.put
    fired = []

    def put(self, piece, *args, **kwargs):
        out = real(self, piece, *args, **kwargs)
        if not fired and ctypes.addressof(ctypes.c_char.from_buffer(piece)) == tensor.data_ptr():
            fired.append(True)
            tensor[index] = value
        return out

    monkeypatch.setattr(writer.ChunkStore, "put", put)


@pytest.mark.parametrize("index", [0, MiB // 8], ids=["edge-page", "interior"])
def test_a_write_while_a_save_reads_is_read_again_by_the_next_save(make_ck, monkeypatch, index):
    """Its page was protected before the read, so the next save sees it written; for an edge
    page, whose bytes are compared by hash, the hash was taken before the read, too."""
    state = {"w": torch.full((MiB,), 1.0)}  # 4 MiB: four regions of 1 MiB
    ck = make_ck(chunk_bytes=MiB)
    _writing_during_the_save(monkeypatch, state["w"], index, 5.0)
    ck.save(1, state, kind="full", rng=False)  # stored with w[index] == 1.0
    monkeypatch.undo()
    ck.save(2, state, kind="incremental", rng=False)  # nothing writes any more
    fresh = {"w": torch.zeros(MiB)}
    make_ck().restore(fresh, step=2)
    assert fresh["w"][index] == 5.0 and torch.equal(fresh["w"], state["w"])
