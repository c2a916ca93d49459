"""What the page cache holds of a store's files (``LocalStore.in_memory``, ``ckptflow.store.page_cache``):
cachestat, the mincore fallback, files of another user, and every way asking can fail."""

from __future__ import annotations

import os

import pytest

from ckptflow.store import LocalStore, Store, page_cache
from support.page_cache import evict


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(str(tmp_path / "root"))


def _page_cache_visible(store: LocalStore) -> bool:
    """Whether this kernel tells this process what the page cache holds of its own files."""
    fd = os.open(store.root, os.O_RDONLY)
    try:
        return page_cache.cached_bytes(fd) is not None
    finally:
        os.close(fd)


def test_in_memory_says_whether_a_read_needs_the_disk(store):
    if not _page_cache_visible(store):
        pytest.skip("this kernel does not say what the page cache holds: in_memory answers False everywhere")
    store.put_if_absent("a/obj", os.urandom(3 << 20))
    store.get("a/obj")
    assert store.in_memory("a/obj")
    evict(os.path.join(store.root, "a", "obj"))
    if store.in_memory("a/obj"):
        pytest.skip("this filesystem keeps its pages in memory (tmpfs)")
    store.get("a/obj")
    assert store.in_memory("a/obj")
    assert not store.in_memory("a/missing")
    os.symlink(os.path.join(store.root, "a", "obj"), os.path.join(store.root, "a", "link"))
    assert not store.in_memory("a/link")  # a hint only, and no link is followed for it
    os.mkfifo(os.path.join(store.root, "a", "fifo"))
    assert not store.in_memory("a/fifo")  # and nothing blocks on a FIFO


def test_kernels_without_cachestat_ask_mincore(store, monkeypatch):
    if not _page_cache_visible(store):
        pytest.skip("this kernel does not say what the page cache holds")
    monkeypatch.setattr(page_cache, "_way", page_cache._mincore)
    store.put_if_absent("obj", os.urandom((8 << 20) + 100))
    store.get("obj")
    assert store.in_memory("obj")
    evict(os.path.join(store.root, "obj"))
    if store.in_memory("obj"):
        pytest.skip("this filesystem keeps its pages in memory (tmpfs)")
    with open(os.path.join(store.root, "obj"), "rb") as f:
        f.read(64 << 10)
        assert 0 < page_cache.cached_bytes(f.fileno()) < os.fstat(f.fileno()).st_size
    assert not store.in_memory("obj")


def test_mincore_is_not_asked_about_files_this_process_may_not_write(store, monkeypatch):
    """Linux answers ``mincore`` truly only for a file the caller owns or may write (it
    reports every page of any other file resident): such a file is "unknown", not cached."""
    store.put_if_absent("obj", b"x" * 5000)
    store.get("obj")
    monkeypatch.setattr(page_cache, "_way", page_cache._mincore)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # neither root nor the owner
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # nor a writer
    fd = os.open(os.path.join(store.root, "obj"), os.O_RDONLY)
    try:
        assert page_cache._mincore(fd) is None
    finally:
        os.close(fd)
    assert not store.in_memory("obj")


def test_in_memory_is_false_where_the_kernel_cannot_say_or_the_answer_fails(store, monkeypatch):
    store.put_if_absent("obj", b"x" * 5000)
    store.get("obj")
    monkeypatch.setattr(page_cache, "_way", None)
    assert not store.in_memory("obj")
    assert not Store.in_memory(store, "obj")  # the base class knows of no page cache

    def failing(fd):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(page_cache, "_way", failing)
    assert not store.in_memory("obj")  # a hint that fails is "on the disk", never an error


def test_the_kernel_is_asked_the_first_way_that_answers_for_a_file_of_its_own(monkeypatch):
    if page_cache._libc_handle is None:
        pytest.skip("not Linux")
    monkeypatch.setattr(page_cache, "_way", page_cache._UNASKED)
    monkeypatch.setattr(page_cache, "_cachestat", lambda fd: None)  # a kernel before 6.5, or a filter
    fd = os.open(__file__, os.O_RDONLY)
    try:
        page_cache.cached_bytes(fd)
    finally:
        os.close(fd)
    assert page_cache._way is page_cache._mincore
