"""What a save costs the local filesystem, per chunk, counted at the system calls.

A chunk write is one file fsync; the directory fsyncs a save's chunks need are deferred
to the end of its chunk writes (``LocalStore.batch``), once per directory, before the
rank record and the commit; and each directory below the root is checked for a link
once per save, not at every path through it. An incremental save that reuses a chunk of
its previous save does not ask the store whether it exists (``ChunkStore.put``'s
``known``): it reads the chunk's header and touches it.
"""

import os
from collections import Counter

import pytest
import torch

from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.store import open_store

CHUNK = 1024  # bytes: 256 chunks of one 256 KiB tensor, into at most 256 directories
METADATA = 40  # calls for everything but the chunks (lease, rank record, manifest, commit records)


@pytest.fixture
def syscalls(monkeypatch):
    counts: Counter = Counter()
    for name in ("fsync", "lstat"):
        real = getattr(os, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, counting)
    return counts


def _chunk_dirs(root: str, step: int) -> tuple[int, int]:
    chunks = catalog.read_manifest(open_store(root), "r", step).chunks
    return len(chunks), len({fmt.chunk_key(d).rsplit("/", 1)[0] for d in chunks})


def test_a_full_save_fsyncs_each_chunk_once_and_each_directory_once(make_ck, ckpt_store_dir, syscalls):
    state = {"w": torch.randn(64 * 1024)}
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)  # the directories exist: the second save rewrites into them
    syscalls.clear()
    ck.save(2, state, kind="full", rng=False)
    chunks, directories = _chunk_dirs(ckpt_store_dir, 2)
    assert chunks == 256 and directories < chunks
    assert syscalls["fsync"] <= chunks + directories + METADATA, syscalls  # was 2 per chunk
    assert syscalls["lstat"] <= chunks + directories + METADATA, syscalls  # was 3 per chunk


def test_an_incremental_save_reuses_a_chunk_with_one_path_lookup(make_ck, ckpt_store_dir, syscalls):
    """It touches the chunk (GC's grace period restarts); its previous save stored it plainly,
    so there is no delta header to read."""
    state = {"w": torch.randn(64 * 1024)}
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)
    syscalls.clear()
    info = ck.save(2, state, kind="incremental", rng=False).info
    chunks, directories = _chunk_dirs(ckpt_store_dir, 2)
    assert info is not None and info.bytes_written == 0
    assert syscalls["lstat"] <= chunks + directories + METADATA, syscalls  # was 10, then 2, per chunk
    assert syscalls["fsync"] <= METADATA, syscalls
    fresh = {"w": torch.zeros(64 * 1024)}
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=2)
    assert torch.equal(fresh["w"], state["w"])


def test_a_chunk_gone_since_the_previous_save_is_written_again(make_ck, ckpt_store_dir):
    state = {"w": torch.randn(1024)}
    ck = make_ck(chunk_bytes=CHUNK)
    ck.save(1, state, kind="full", rng=False)
    store = open_store(ckpt_store_dir)
    victims = sorted(info.key for info in store.list("chunks/"))[:2]
    for key in victims:
        store.delete(key)
    info = ck.save(2, state, kind="incremental", rng=False).info
    assert info is not None and info.bytes_written == 2 * CHUNK
    assert all(store.stat(key).size > 0 for key in victims)
    fresh = {"w": torch.zeros(1024)}
    make_ck(chunk_bytes=CHUNK).restore(fresh, step=2)
    assert torch.equal(fresh["w"], state["w"])


def test_a_chunk_another_process_wrote_in_its_batch_is_made_durable_by_the_batch_that_reuses_it(tmp_path):
    """Two processes saving into one store (two stores on one root here): the first has
    written a chunk and deferred its directory's fsync to its batch's end; the second
    finds the chunk there and will name it in its own commit, so the second's batch end
    fsyncs that directory too, whichever of the two finishes first."""
    from ckptflow.store.disk import Disk
    from ckptflow.store.local import LocalStore

    class Recording(Disk):
        def __init__(self) -> None:
            super().__init__()
            self.synced: list[str] = []

        def fsync_dir(self, path: str) -> None:
            self.synced.append(path)
            super().fsync_dir(path)

    root = str(tmp_path / "store")
    first, second = LocalStore(root, disk=Recording()), LocalStore(root, disk=Recording())
    key = "chunks/ab/" + "ab" * 32
    directory = os.path.join(first.root, "chunks", "ab")
    with first.batch():
        assert first.put_if_absent(key, b"the same bytes")
        assert directory not in first.disk.synced  # deferred to the end of its batch
        with second.batch():
            assert not second.put_if_absent(key, b"the same bytes")
        assert directory in second.disk.synced
    assert directory in first.disk.synced
