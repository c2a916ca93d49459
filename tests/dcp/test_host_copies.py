"""A blocking save copies a GPU tensor to host memory one chunk at a time, and no further
ahead of its writes than the copy-ahead limit (``ckptflow.dcp.host_copies``). The class is
device-agnostic: these tests drive it with CPU tensors and a thread pool whose writes wait
on an event; ``tests/gpu`` runs a save of a GPU state through it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptflow.dcp.host_copies import HostCopies, copied_in_chunks
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
