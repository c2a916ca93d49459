"""A blocking save copies a GPU tensor to host memory one chunk at a time, and no further
ahead of its writes than the copy-ahead limit (``ckptflow.dcp.host_copies``). The class is
device-agnostic: these tests drive it with CPU tensors and a thread pool whose writes wait
on an event; ``tests/gpu`` runs a save of a GPU state through it."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptflow import Checkpointer
from ckptflow.chunks.io import ChunkStore
from ckptflow.dcp import host_copies, writer
from ckptflow.dcp.host_copies import HostCopies, copied_in_chunks
from ckptflow.dcp.memory import tensor_memory
from ckptflow.dcp.put_batches import PutBatches

CHUNK = 1024


def test_copies_wait_for_the_oldest_writes_beyond_the_limit():
    release, started = threading.Event(), []

    def put(piece, name):
        started.append(name)
        release.wait(10)
        return bytes(piece)

    tensor = torch.arange(5 * CHUNK // 4, dtype=torch.float32)
    made = []
    with ThreadPoolExecutor(4) as pool:
        batches = PutBatches(pool, put, CHUNK, jobs=1)
        copies = HostCopies(batches, limit=2 * CHUNK)
        pieces = copies.pieces(tensor, CHUNK)
        for i in range(2):
            piece = next(pieces)
            made.append(bytes(piece))
            copies.queued(len(piece), batches.add(piece, i))
        third = threading.Thread(target=lambda: made.append(bytes(next(pieces))))
        third.start()
        third.join(0.3)
        assert third.is_alive(), "a third copy was made while two chunks' writes were still in flight"
        release.set()
        third.join(10)
        assert not third.is_alive()
    assert b"".join(made) == tensor.numpy().tobytes()[: 3 * CHUNK]


def test_pieces_are_the_tensors_bytes_in_order_whatever_its_layout():
    tensor = torch.arange(3000, dtype=torch.int16).reshape(60, 50).t()  # not contiguous
    with ThreadPoolExecutor(2) as pool:
        batches = PutBatches(pool, lambda piece: bytes(piece), CHUNK, jobs=1)
        copies = HostCopies(batches, limit=CHUNK)
        out = b""
        for piece in copies.pieces(tensor, CHUNK):
            out += bytes(piece)
            copies.queued(len(piece), batches.add(piece))
    assert out == tensor.contiguous().numpy().tobytes()
    assert len(out) == 6000


def test_only_tensors_on_a_device_are_copied_in_chunks():
    assert not copied_in_chunks(torch.zeros(4))
    assert not copied_in_chunks(torch.zeros(4).t())
    assert not copied_in_chunks(torch.zeros(4, device="meta"))


def test_small_tensors_in_packs_are_copied_no_further_ahead_of_their_writes(tmp_path, monkeypatch):
    """A pack's members were copied whole (``bytes_view``) outside the copy-ahead: with the
    writes lagging, a GPU state of small tensors was copied to host memory entirely. CPU
    tensors stand in for device ones here, their ``bytes_view`` a copy as a device's is."""
    copies = []

    def copying_view(tensor):
        copies.append(tensor)
        return tensor_memory(tensor.detach().reshape(-1).clone())

    monkeypatch.setattr(writer, "copied_in_chunks", lambda tensor: True)
    monkeypatch.setattr(writer, "bytes_view", copying_view)
    monkeypatch.setattr(host_copies, "bytes_view", copying_view, raising=False)
    monkeypatch.setattr(writer, "HostCopies", functools.partial(HostCopies, limit=64 << 10))
    release, put = threading.Event(), ChunkStore.put
    monkeypatch.setattr(ChunkStore, "put", lambda self, *a, **k: (release.wait(10), put(self, *a, **k))[1])
    state = {"model": {f"t{i}": torch.randn(4096) for i in range(64)}}  # 16 KiB each: 4 to a pack of 64 KiB
    with Checkpointer(str(tmp_path / "store"), "r", pack_bytes=64 << 10) as ck:
        save = threading.Thread(target=ck.save, args=(1, state))
        save.start()
        time.sleep(0.5)
        made = len(copies)
        release.set()
        save.join(30)
        assert made <= 8, f"{made} small tensors copied while no write could finish (the limit holds 4)"
        target = {"model": {name: torch.zeros(4096) for name in state["model"]}}
        ck.restore(target, step=1)
    assert all(torch.equal(target["model"][name], t) for name, t in state["model"].items())
