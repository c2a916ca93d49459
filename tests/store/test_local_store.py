"""LocalStore semantics, key and run-name validation, open_store and chunk re-encoding (codecs: chunks/test_codecs)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from blake3 import blake3

from ckptflow import Checkpointer, CorruptChunkError, InvalidNameError, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.format.checksum import address_of
from ckptflow.store import LocalStore, Store, local_writes


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(str(tmp_path / "root"))


def _all_files(directory) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(dirpath, f), directory) for f in files]
    return sorted(out)


# ---- basic operations ---------------------------------------------------------------------


def test_put_if_absent_creates_once(store):
    assert store.put_if_absent("a/b/obj", b"first") is True
    assert store.get("a/b/obj") == b"first"
    assert store.put_if_absent("a/b/obj", b"second") is False
    assert store.get("a/b/obj") == b"first"
    # several buffers are concatenated
    assert store.put_if_absent("multi", [b"ab", memoryview(b"cd"), b""]) is True
    assert store.get("multi") == b"abcd"
    # no temp files left behind
    assert not [f for f in _all_files(store.root) if os.path.basename(f).startswith(".")]


def test_put_if_absent_concurrent_creators_one_winner(store):
    results = []
    barrier = threading.Barrier(8)

    def create(i):
        barrier.wait()
        results.append((i, store.put_if_absent("race", f"writer-{i}".encode())))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results if won]
    assert len(winners) == 1
    assert store.get("race") == f"writer-{winners[0]}".encode()


def test_writers_in_a_directory_that_deletes_keep_pruning_never_fail(tmp_path):
    """Savers take and drop leases in one directory; each drop removes the directory when it
    leaves it empty, which raced another saver's mkdir or open there (FileNotFoundError out
    of a save on two gloo ranks). Three writers churning one directory: no write fails."""
    root, errors = str(tmp_path / "root"), []

    def churn(name: str) -> None:
        store = LocalStore(root, fsync=False)
        for i in range(1500):
            key = f"locks/leases/{name}-{i}.json"
            try:
                assert store.put_if_absent(key, b"lease")
                store.delete(key)
            except Exception as e:  # collected: an assertion in a thread would be lost
                errors.append(repr(e))

    threads = [threading.Thread(target=churn, args=(name,)) for name in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_write_whose_directory_stays_pruned_gives_up_after_bounded_paused_retries(monkeypatch):
    """The retry is a bound, not a loop forever: a directory that vanishes at every attempt
    fails the write after ``PRUNED_RETRIES`` attempts, pausing (random, under
    ``PRUNED_BACKOFF_S``) before each retry after the first; other errors are not retried."""
    attempts, pauses = [], []
    monkeypatch.setattr(local_writes.time, "sleep", pauses.append)

    def vanished() -> None:
        attempts.append(1)
        raise FileNotFoundError("pruned")

    with pytest.raises(FileNotFoundError):
        local_writes.retrying_pruned(vanished)
    assert len(attempts) == local_writes.PRUNED_RETRIES
    assert len(pauses) == local_writes.PRUNED_RETRIES - 2
    assert all(0 <= p < local_writes.PRUNED_BACKOFF_S for p in pauses) and len(set(pauses)) > 1

    def denied() -> None:
        attempts.append(1)
        raise PermissionError("no")

    attempts.clear()
    with pytest.raises(PermissionError):
        local_writes.retrying_pruned(denied)
    assert len(attempts) == 1


def test_replace_overwrites_atomically(store):
    store.replace("x/y", b"old")
    assert store.get("x/y") == b"old"
    store.replace("x/y", [b"new", b"-", b"bytes"])
    assert store.get("x/y") == b"new-bytes"
    # nothing but the object itself in its directory (no temp file)
    assert os.listdir(os.path.join(store.root, "x")) == ["y"]
    # replace is what a manifest-sized object uses: the old inode is untouched by a
    # reader that opened it before the replace (rename semantics)
    path = os.path.join(store.root, "x", "y")
    with open(path, "rb") as reader:
        store.replace("x/y", b"newer")
        assert reader.read() == b"new-bytes"
    assert store.get("x/y") == b"newer"


def test_get_and_stat_missing(store):
    with pytest.raises(ObjectNotFoundError):
        store.get("nope")
    with pytest.raises(ObjectNotFoundError):
        store.stat("nope/deeper")
    with pytest.raises(KeyError):  # ObjectNotFoundError is a KeyError too
        store.get("nope")
    store.put_if_absent("file", b"1")
    with pytest.raises(ObjectNotFoundError):
        store.get("file/child")  # a path through a file
    assert store.exists("file") and not store.exists("nope")


def test_stat(store):
    store.put_if_absent("s/obj", b"12345")
    info = store.stat("s/obj")
    assert info.key == "s/obj" and info.size == 5
    assert abs(info.mtime - os.stat(os.path.join(store.root, "s", "obj")).st_mtime) < 1e-6
    store.touch("s/obj")
    assert store.stat("s/obj").mtime >= info.mtime
    with pytest.raises(ObjectNotFoundError):
        store.touch("s/none")


def test_delete(store):
    store.put_if_absent("d/obj", b"x")
    store.delete("d/obj")
    assert not store.exists("d/obj")
    with pytest.raises(ObjectNotFoundError):
        store.get("d/obj")
    store.delete("d/obj")  # absent: no error
    store.delete("never/was")
    # a deleted key can be created again
    assert store.put_if_absent("d/obj", b"y") is True


def test_list_recursive_and_not(store):
    for key, data in [("a/b/c", b"1"), ("a/d", b"22"), ("e", b"333"), ("a/b/f", b"4444")]:
        store.put_if_absent(key, data)
    # a hidden temp file (as a crashed writer leaves) is never listed
    with open(os.path.join(store.root, "a", ".tmp-leftover"), "wb") as f:
        f.write(b"junk")

    everything = list(store.list(""))
    assert [i.key for i in everything] == ["a/b/c", "a/b/f", "a/d", "e"]
    assert [i.size for i in everything] == [1, 4, 2, 3]

    assert [i.key for i in store.list("", recursive=False)] == ["a/", "e"]
    top = {i.key: i for i in store.list("", recursive=False)}
    assert top["a/"].size == 0

    assert [i.key for i in store.list("a/")] == ["a/b/c", "a/b/f", "a/d"]
    assert [i.key for i in store.list("a/", recursive=False)] == ["a/b/", "a/d"]
    assert [i.key for i in store.list("a/b/", recursive=False)] == ["a/b/c", "a/b/f"]
    assert list(store.list("missing/")) == []
    assert list(store.list("missing/", recursive=False)) == []


BAD_KEYS = [
    "../x",
    "/abs",
    "a//b",
    ".hidden",
    "a/../b",
    "a/.b",
    "a/",
    "",
    "a/./b",
    "a\\..\\b",
    "..",
    "a/b/..",
    "a\n",
    "a\n/b",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_refused_keys(tmp_path, key):
    root = tmp_path / "root"
    store = LocalStore(str(root))
    before = _all_files(tmp_path)
    for op in (
        lambda: store.get(key),
        lambda: store.put_if_absent(key, b"evil"),
        lambda: store.replace(key, b"evil"),
        lambda: store.stat(key),
        lambda: store.delete(key),
        lambda: store.touch(key),
        lambda: store.exists(key),
    ):
        with pytest.raises(InvalidNameError):
            op()
    assert _all_files(tmp_path) == before  # nothing written anywhere, inside or outside root
    assert not (tmp_path / "x").exists()


def test_refused_list_prefix(store):
    with pytest.raises(InvalidNameError):
        list(store.list("../"))


@pytest.mark.parametrize(
    "run", ["../x", "a/b", "", "a__b", "..", ".hidden", "/abs", "a..b", "x" * 200, "a b", None, "r\n", "r\nx"]
)
def test_refused_run_names(tmp_path, run):
    root = tmp_path / "store"
    with pytest.raises(InvalidNameError, match="run name"):
        Checkpointer(str(root), run=run)
    # nothing outside the root, nothing inside it either
    assert sorted(os.listdir(tmp_path)) in ([], ["store"])
    assert _all_files(tmp_path) == []


def test_accepted_run_names(tmp_path):
    for run in ["gpt-small-001", "a", "A.b_c-1", "9lives"]:
        with Checkpointer(str(tmp_path / "s"), run=run) as ck:
            assert ck.run == run


@pytest.mark.parametrize("step", [-1, 10**12, 1.0, "3", True])
def test_refused_steps(tmp_path, step):
    with Checkpointer(str(tmp_path / "s"), run="r") as ck:
        with pytest.raises(InvalidNameError):
            ck.save(step, {"model": torch.nn.Linear(2, 2)})
    assert _all_files(tmp_path) == []


# ---- open_store ---------------------------------------------------------------------------


def test_open_store_plain_path_and_file_url(tmp_path):
    plain = open_store(str(tmp_path / "p"))
    assert isinstance(plain, LocalStore)
    assert plain.root == str(tmp_path / "p") and os.path.isdir(plain.root)
    assert plain.url == "file://" + str(tmp_path / "p")

    via_url = open_store("file://" + str(tmp_path / "p"))
    assert isinstance(via_url, LocalStore) and via_url.root == plain.root
    plain.put_if_absent("k", b"v")
    assert via_url.get("k") == b"v"

    localhost = open_store("file://localhost" + str(tmp_path / "p"))
    assert localhost.root == plain.root

    spaced = open_store("file://" + str(tmp_path / "with%20space"))
    assert spaced.root == str(tmp_path / "with space")

    assert open_store(plain) is plain  # a Store passes through
    assert isinstance(plain, Store)


def test_open_store_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    st = open_store("rel/dir")
    assert st.root == str(tmp_path / "rel" / "dir")


@pytest.mark.parametrize("url", ["gs://b/p", "http://example.com/x", "ftp://h/p"])
def test_open_store_unknown_scheme(url):
    scheme = url.split(":", 1)[0]
    with pytest.raises(ValueError, match=repr(scheme)):
        open_store(url)


def test_open_store_file_url_with_host_is_refused(tmp_path):
    with pytest.raises(ValueError, match="host"):
        open_store("file://otherhost/tmp/x")


def _weights(n=4096) -> bytes:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(n).astype(np.float32) * 0.02).tobytes()


# ---- chunk store and re-encoding ----------------------------------------------------------


def test_chunk_put_get_and_dedup(store):
    chunks = ChunkStore(store)
    data = _weights(1024)
    w1 = chunks.put(memoryview(data), codec="raw", itemsize=4)
    assert w1.digest == blake3(data).hexdigest() == address_of(data) and w1.raw_bytes == len(data) and w1.written
    w2 = chunks.put(memoryview(data), codec="zstd", itemsize=4)
    assert w2.digest == w1.digest and not w2.written
    assert codecs.header_codec(store.get(fmt.chunk_key(w1.digest))) == "raw"  # left alone
    assert bytes(chunks.get(w1.digest, len(data))) == data
    with pytest.raises(CorruptChunkError, match="expects"):
        chunks.get(w1.digest, len(data) + 1)
    with pytest.raises(CorruptChunkError, match="missing"):
        chunks.get("0" * 64, 1)


def test_reencode_keeps_address_and_verifies(store):
    chunks = ChunkStore(store)
    data = _weights(8192)
    digest = chunks.put(memoryview(data), codec="raw").digest
    key = fmt.chunk_key(digest)
    before, after = chunks.reencode(digest, len(data), "zstd", itemsize=4)
    assert before == len(data) + codecs.HEADER.size
    assert after < before and store.stat(key).size == after
    assert codecs.header_codec(store.get(key)) == "zstd"
    assert [i.key for i in store.list("chunks/")] == [key]  # same address, no new object
    assert bytes(chunks.get(digest, len(data))) == data
    # and back to raw
    chunks.reencode(digest, len(data), "raw")
    assert codecs.header_codec(store.get(key)) == "raw"
    assert bytes(chunks.get(digest, len(data))) == data


def test_reencode_refuses_a_corrupt_chunk(store):
    chunks = ChunkStore(store)
    data = _weights(256)
    digest = chunks.put(memoryview(data)).digest
    path = os.path.join(store.root, *fmt.chunk_key(digest).split("/"))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(CorruptChunkError):
        chunks.reencode(digest, len(data), "zstd", itemsize=4)
    # it was not "repaired" into a chunk that now verifies with wrong content
    with pytest.raises(CorruptChunkError):
        chunks.get(digest, len(data))


def test_reencoded_checkpoint_still_verifies_and_restores(tmp_path):
    root = str(tmp_path / "s")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(root, run="r", chunk_bytes=4096) as ck:
        info = ck.save(1, {"model": model}).info
        assert info.stored_bytes > info.logical_bytes  # raw + headers
    st = open_store(root)
    manifest = catalog.read_manifest(st, "r", 1)
    chunks = ChunkStore(st)
    for digest, size in manifest.chunks.items():
        chunks.reencode(digest, size, "zstd", itemsize=4)
        assert codecs.header_codec(st.get(fmt.chunk_key(digest))) == "zstd"
    with Checkpointer(root, run="r") as ck:
        report = ck.verify(1)
        assert report.ok, report.problems
        assert report.chunks_checked == len(manifest.chunks)
        fresh = torch.nn.Linear(64, 64)
        assert ck.restore({"model": fresh}).step == 1
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_checkpointer_with_zstd_codec_round_trip(tmp_path):
    root = str(tmp_path / "s")
    torch.manual_seed(1)
    model = torch.nn.Linear(128, 64)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(root, run="r", codec="zstd") as ck:
        info = ck.save(1, {"model": model}).info
        assert info.stored_bytes < info.logical_bytes
        st = open_store(root)
        manifest = catalog.read_manifest(st, "r", 1)
        assert manifest.codec == "zstd"
        assert {codecs.header_codec(st.get(fmt.chunk_key(d))) for d in manifest.chunks} == {"zstd"}
        with torch.no_grad():
            model.weight.zero_()
        assert ck.restore({"model": model}).step == 1
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v)
