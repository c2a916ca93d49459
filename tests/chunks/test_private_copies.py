"""Private copies of live chunks (``ckptflow.chunks.private_copies``): what is hashed is what is stored."""

from __future__ import annotations

import os
import threading

import pytest

from ckptflow.chunks import private_copies
from ckptflow.chunks.private_copies import PrivateCopies, copy_and_hash
from ckptflow.format.checksum import PIECE, address_of, fast_checksum


@pytest.mark.parametrize("size", [0, 1, 7, 8, PIECE - 3, PIECE, 3 * PIECE + 5])
def test_the_copy_and_both_hashes_name_the_source_bytes(size):
    source = memoryview(os.urandom(size))
    into = memoryview(bytearray(size + 16))[:size]
    address, checksum = copy_and_hash(source, into, address=True)
    assert bytes(into) == bytes(source)
    assert address == address_of(source)
    assert checksum == fast_checksum(source)
    assert copy_and_hash(source, into, address=False) == ("", checksum)


def test_a_copy_is_private_and_its_buffer_serves_the_next_chunk():
    copies = PrivateCopies(1 << 20)
    source = bytearray(os.urandom(4096))
    with copies.copy(memoryview(source), address=False) as (copy, _, checksum):
        first = copy.obj
        source[0] ^= 0xFF  # the owner writes its tensor while the copy is stored
        assert copy[0] != source[0] and fast_checksum(copy) == checksum
    with copies.copy(memoryview(source), address=True) as (copy, address, _):
        assert copy.obj is first  # reused, not allocated again
        assert bytes(copy) == bytes(source) and address == address_of(source)


def test_copies_held_at_once_are_bounded_and_a_writer_waits_for_a_free_one():
    copies = PrivateCopies(1 << 20, limit=2 << 20)  # two chunks' worth
    assert copies.slots == 2
    held, release, took_third = threading.Event(), threading.Event(), threading.Event()

    def hold():
        with copies.copy(memoryview(b"x" * 1024), address=False):
            held.set()
            release.wait(10)

    def third():
        with copies.copy(memoryview(b"y" * 1024), address=False):
            took_third.set()

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        held.clear()
        t.start()
        assert held.wait(10)
    waiting = threading.Thread(target=third)
    waiting.start()
    assert not took_third.wait(0.3)  # both buffers are taken: it waits
    release.set()
    assert took_third.wait(10)
    for t in [*holders, waiting]:
        t.join(10)


def test_a_buffer_that_cannot_be_allocated_gives_its_slot_back(monkeypatch):
    copies = PrivateCopies(1 << 20, limit=1 << 20)  # one slot: a leaked one would hang every later writer
    real = private_copies.np.empty

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no memory for a private copy")

    monkeypatch.setattr(private_copies.np, "empty", out_of_memory)
    with pytest.raises(MemoryError):
        with copies.copy(memoryview(b"x" * 1024), address=False):
            pass
    monkeypatch.setattr(private_copies.np, "empty", real)
    done = threading.Event()

    def put():
        with copies.copy(memoryview(b"y" * 1024), address=False) as (copy, _, _checksum):
            assert bytes(copy) == b"y" * 1024
            done.set()

    writer = threading.Thread(target=put)
    writer.start()
    assert done.wait(10)  # the slot came back
    writer.join(10)
