"""Which threads a restore reads chunks on: a chunk the page cache holds is CPU work, read
on one thread per core; one that must come from the disk is read on the restore's wide
pool, which keeps many reads in flight (``CheckpointReader._pool_for``); a small cached one on
the restoring thread (``CheckpointReader._here``)."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import pytest
import torch

from ckptflow import Checkpointer, PartialRestoreError
from ckptflow.chunks import reads
from ckptflow.chunks.io import ChunkStore
from ckptflow.dcp.reader import CheckpointReader
from ckptflow.store import LocalStore
from support.page_cache import evict
from support.states import assert_tensors_equal, blank_like


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64 << 10, generator=gen) for i in range(8)}  # 256 KiB each


def _chunk_files(root) -> list[str]:
    chunks = os.path.join(root, "chunks")
    return sorted(os.path.join(d, f) for d, _, files in os.walk(chunks) for f in files)


def _half_evicted(root: str) -> tuple[list[str], set[str]]:
    """Every chunk file, and the half of them evicted from the page cache (the test is
    skipped where the kernel cannot say so, or keeps them in memory anyway)."""
    files = _chunk_files(root)
    evicted = set(files[::2])
    for path in evicted:
        evict(path)
    store = LocalStore(root)
    if not all(store.in_memory(os.path.relpath(p, root)) for p in files if p not in evicted):
        pytest.skip("this kernel does not say what the page cache holds")
    if any(store.in_memory(os.path.relpath(p, root)) for p in evicted):
        pytest.skip("this filesystem keeps its pages in memory (tmpfs)")
    return files, evicted


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_cached_chunks_are_read_one_per_core_and_the_rest_on_the_wide_pool(tmp_path, monkeypatch, codec):
    root = str(tmp_path / "store")
    state = _state()
    with Checkpointer(root, "r", chunk_bytes=256 << 10, codec=codec, threads=6) as ck:
        ck.save(1, {"model": state}, kind="full")
        files, evicted = _half_evicted(root)
        readers: dict[str, list[str]] = defaultdict(list)  # chunk key -> the threads that read it, in order

        def recording(read):
            def record(self, key, *args, **kwargs):
                readers[key].append(threading.current_thread().name)
                return read(self, key, *args, **kwargs)

            return record

        for name in ("scan", "get_into", "get_bounded"):  # every way a restore reads a chunk
            monkeypatch.setattr(LocalStore, name, recording(getattr(LocalStore, name)))
        target = {"model": blank_like(state)}
        ck.restore(target)
    assert_tensors_equal(target["model"], state)
    chunk_reads = {key: names for key, names in readers.items() if key.startswith("chunks/")}
    assert sorted(os.path.join(root, key) for key in chunk_reads) == files
    per_core = {name for names in chunk_reads.values() for name in names if name.startswith("ckptflow-cpu")}
    assert 1 <= len(per_core) <= reads.CORES
    for key, names in chunk_reads.items():
        # pass one reads each chunk once; pass two once more, unless pass one kept it decoded
        assert len(names) in (1, 2), f"{key}: read {len(names)} times"
        verified, *into_place = names
        if os.path.join(root, key) in evicted:
            assert not verified.startswith("ckptflow-cpu"), f"{key} came from the disk on a per-core thread"
        else:
            assert verified.startswith("ckptflow-cpu"), f"{key} was in memory, yet pass one read it on {verified}"
        # pass two reads what pass one just brought into memory: CPU work, one thread per core
        assert all(name.startswith("ckptflow-cpu") for name in into_place), f"{key}: pass two read it on {into_place}"
    if codec == "raw":
        assert all(len(names) == 2 for names in chunk_reads.values())


def test_a_failure_between_submits_leaves_no_read_writing_after_restore_returns(tmp_path, monkeypatch):
    """Whatever fails while pass two hands chunks to its threads, every read already handed
    over has finished when restore raises: nothing writes into the caller's tensors after."""
    root = str(tmp_path / "store")
    state = _state()
    with Checkpointer(root, "r", chunk_bytes=64 << 10, threads=6) as ck:  # 4 chunks a tensor
        ck.save(1, {"model": state}, kind="full")
        started: list[float] = []
        finished: list[float] = []
        real_read = ChunkStore.read_checked

        def slow_read(self, checked, out):
            started.append(time.monotonic())
            time.sleep(0.3)
            real_read(self, checked, out)
            finished.append(time.monotonic())

        handed = [0]
        real_pool_for = CheckpointReader._pool_for

        def failing_pool_for(self, per_core, *, cpu_only):
            handed[0] += 1
            if handed[0] == 32 + 3:  # pass one's 32 chunks, then the 3rd of pass two: within a tensor
                time.sleep(0.02)  # the reads handed over have started
                raise RuntimeError("the scheduler failed")
            return real_pool_for(self, per_core, cpu_only=cpu_only)

        monkeypatch.setattr(ChunkStore, "read_checked", slow_read)
        monkeypatch.setattr(CheckpointReader, "_pool_for", failing_pool_for)
        monkeypatch.setattr(
            LocalStore, "in_memory", lambda self, key: False
        )  # the wide pool, not waited for by shutdown
        with pytest.raises(PartialRestoreError):
            ck.restore({"model": blank_like(state)})
        raised = time.monotonic()
        time.sleep(0.5)  # long enough for any read still running to finish
    assert started, "pass two handed no chunk over before the failure"
    assert len(finished) == len(started) and max(finished) <= raised  # those not started were cancelled


def test_small_cached_chunks_are_read_on_the_restoring_thread_itself(tmp_path, monkeypatch):
    """Below ``SMALL_CHUNK`` a chunk's fixed cost outweighs its bytes: one the page cache holds
    is read by the thread that restores, in both passes; one on the disk still goes wide."""
    root = str(tmp_path / "store")
    state = _state()
    with Checkpointer(root, "r", chunk_bytes=64 << 10, threads=6) as ck:  # 4 chunks a tensor
        ck.save(1, {"model": state}, kind="full")
        files, evicted = _half_evicted(root)
        readers: dict[str, list[str]] = defaultdict(list)
        for name in ("scan", "get_into"):
            read = getattr(LocalStore, name)

            def record(self, key, *args, _read=read, **kwargs):
                readers[key].append(threading.current_thread().name)
                return _read(self, key, *args, **kwargs)

            monkeypatch.setattr(LocalStore, name, record)
        restoring = threading.current_thread().name
        target = {"model": blank_like(state)}
        ck.restore(target)
    assert_tensors_equal(target["model"], state)
    chunk_reads = {os.path.join(root, key): names for key, names in readers.items() if key.startswith("chunks/")}
    assert sorted(chunk_reads) == files
    for path, (verified, into_place) in chunk_reads.items():
        if path in evicted:
            assert verified != restoring and not verified.startswith("ckptflow-cpu"), f"{path}: read on {verified}"
        else:
            assert verified == restoring, f"{path} was in memory, yet pass one read it on {verified}"
        assert into_place == restoring, f"{path}: pass two read it on {into_place}"  # in memory after pass one
