"""The core store-level guarantees on every backend: the ``store_url`` fixture runs each
test on a local directory and on a bucket of a real S3 API server (moto over HTTP).

Store semantics, round trip, dedup, corruption detection and fallback (damage done
through the store API, so the same test works on both), crash-point enumeration
(FaultyStore over the backend) and GC. The local-only suites (store/test_local_store,
training/test_crashes, catalog/test_gc, catalog/test_corruption) go deeper with file-level
damage and SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from urllib.parse import urlparse, urlunparse

import pytest

from ckptflow import Checkpointer, NoValidCheckpointError, StoreUnavailableError, gc, open_store
from ckptflow.chunks import leases
from ckptflow.errors import ObjectNotFoundError, ObjectTooLargeError
from ckptflow.format import layout as fmt
from support.corrupt import rank_files
from support.faulty_store import FaultyStore, InjectedFault
from support.states import CHUNK, RUN, assert_state_equals, blank_state, snapshot, state_tag, tagged_state


def sub_url(url: str, name: str) -> str:
    """A separate store root below ``url`` (a subdirectory, or a longer S3 prefix)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return urlunparse(parsed._replace(path=f"{parsed.path.rstrip('/')}/{name}"))
    return os.path.join(url, name)


def chunk_keys(store) -> set[str]:
    return {info.key for info in store.list("chunks/")}


def manifest_chunks(store, step: int) -> set[str]:
    return {fmt.chunk_key(d) for d in json.loads(store.get(fmt.manifest_key(RUN, step)))["chunks"]}


# ---- the Store interface -------------------------------------------------------------------
def test_store_semantics(store_url):
    store = open_store(store_url)
    assert store.put_if_absent("a/b/obj", [b"fi", memoryview(b"rst")]) is True
    assert store.put_if_absent("a/b/obj", b"second") is False
    assert store.get("a/b/obj") == b"first"
    store.replace("a/b/obj", b"new")
    store.replace("a/top", b"22")
    store.put_if_absent("e", b"333")
    assert store.get("a/b/obj") == b"new"
    assert [(i.key, i.size) for i in store.list("")] == [("a/b/obj", 3), ("a/top", 2), ("e", 3)]
    assert [i.key for i in store.list("", recursive=False)] == ["a/", "e"]
    assert [i.key for i in store.list("a/", recursive=False)] == ["a/b/", "a/top"]
    assert [i.key for i in store.list_after("a/", "a/b")] == ["a/b/obj", "a/top"]  # keys sorting after it
    assert [i.key for i in store.list_after("a/", "a/b/obj")] == ["a/top"]
    assert list(store.list_after("a/", "a/top")) == []
    store.replace("a/b/obj2", b"4444")  # rolled up with a/b/obj into one entry, as S3's Delimiter does
    assert [(i.key, i.size) for i in store.list_after("a/", roll_up="/obj")] == [("a/b/obj", 0), ("a/top", 2)]
    assert [i.key for i in store.list_after("a/", "a/b/obj2", roll_up="/obj")] == ["a/top"]
    store.delete("a/b/obj2")
    assert [i.mtime for i in store.list("e")] == [] and store.stat("a/top").mtime == pytest.approx(
        next(i.mtime for i in store.list("a/") if i.key == "a/top"), abs=1.0
    )  # a listing's times (parsed by the standard library on S3) are the objects' times
    assert list(store.list("missing/")) == []
    info = store.stat("e")
    assert info.size == 3 and abs(info.mtime - time.time()) < 60
    store.touch("e")
    assert store.stat("e").mtime >= info.mtime
    store.delete("e")
    store.delete("e")  # absent: fine
    for op in (lambda: store.get("e"), lambda: store.stat("e")):
        with pytest.raises(ObjectNotFoundError):
            op()
    assert not store.exists("e") and store.exists("a/top")


def test_the_head_of_an_empty_object_is_empty_on_every_backend(store_url):
    """``read_head`` reads all of an object shorter than asked for, on every backend alike: S3
    refuses any range of an empty object (416), which raised a StoreError there (what a save
    reusing a chunk calls) where a local store read b"" and left the checks to the readers."""
    store = open_store(store_url)
    store.put_if_absent("chunks/ab/empty", b"")
    store.put_if_absent("chunks/ab/short", b"abc")
    assert store.read_head("chunks/ab/empty", 46) == b"" and store.read_head("chunks/ab/short", 46) == b"abc"
    with pytest.raises(ObjectNotFoundError):
        store.read_head("chunks/ab/absent", 46)


def test_conditional_delete_removes_only_the_version_read(store_url):
    store = open_store(store_url)
    store.put_if_absent("m/manifest", b"damaged")
    _, old = store.get_versioned("m/manifest")
    store.delete("m/manifest")
    store.put_if_absent("m/manifest", b"a valid commit made meanwhile")
    assert store.delete_if("m/manifest", old) is False
    assert store.get("m/manifest") == b"a valid commit made meanwhile"  # kept, and nothing left aside
    assert [i.key for i in store.list("m/")] == ["m/manifest"]
    if "://" not in store_url:  # the local backend took it aside to compare, then put it back
        assert os.listdir(os.path.join(store_url, "m")) == ["manifest"]
    _, current = store.get_versioned("m/manifest")
    assert store.delete_if("m/manifest", current) is True and not store.exists("m/manifest")
    assert store.delete_if("m/manifest", current) is False  # absent
    store.put_if_absent("m/big", b"x" * 100)
    with pytest.raises(ObjectTooLargeError):
        store.get_versioned("m/big", 99)
    version, size = store.version_and_size("m/big")  # what expiry deletes a record too large to read by
    assert (version, size) == (store.get_versioned("m/big")[1], 100)
    store.replace("m/big", b"y" * 100)
    assert store.delete_if("m/big", version) is False and store.exists("m/big")
    with pytest.raises(ObjectNotFoundError):
        store.version_and_size("m/absent")


# ---- round trip and dedup ------------------------------------------------------------------
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_round_trip(store_url, tiny_state_factory, tiny_train_step, blocking):
    state = tiny_state_factory(seed=0)
    tiny_train_step(state, 2)
    expected = snapshot(state)
    with Checkpointer(store_url, run="rt", chunk_bytes=512) as ck:
        saved = ck.save(5, state, metadata={"loss": 0.5}, blocking=blocking)
        saved = saved if blocking else saved.wait()
        assert saved.info.chunks > 1
        tiny_train_step(state, 1)
    with Checkpointer(store_url, run="rt") as ck:
        fresh = tiny_state_factory(seed=7)
        result = ck.restore(fresh)
        assert (result.step, result.metadata, result.skipped) == (5, {"loss": 0.5}, [])
        assert ck.verify(5).ok
        assert [i.step for i in ck.list()] == [5]
    assert_state_equals(fresh, expected)


def test_dedup_across_steps(store_url):
    store = open_store(store_url)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        first = ck.save(1, tagged_state(2)).info
        again = ck.save(2, tagged_state(2), kind="incremental").info
        changed = ck.save(3, tagged_state(3), kind="incremental").info
    assert first.bytes_written > 0
    assert again.bytes_written == 0  # identical content: every chunk already stored
    assert 0 < changed.bytes_written < first.bytes_written  # only what changed ("shared" is reused)
    assert manifest_chunks(store, 1) == manifest_chunks(store, 2)
    assert chunk_keys(store) == manifest_chunks(store, 1) | manifest_chunks(store, 3)


# ---- corruption detection and fallback -----------------------------------------------------
def _damage(store, key: str, how: str) -> None:
    blob = store.get(key)
    if how == "flip":
        store.replace(key, blob[:-3] + bytes([blob[-3] ^ 0x5A]) + blob[-2:])
    elif how == "truncate":
        store.replace(key, blob[: len(blob) // 2])
    elif how == "delete":
        store.delete(key)
    elif how == "forge":  # still valid JSON, but the checksum no longer matches
        record = json.loads(blob)
        record["metadata"] = {"forged": True}
        store.replace(key, json.dumps(record).encode())


@pytest.mark.parametrize(
    "target,how",
    [("chunk", "flip"), ("chunk", "truncate"), ("chunk", "delete"), ("manifest", "forge"), ("manifest", "truncate")],
)
def test_corruption_is_detected_and_restore_falls_back(store_url, target, how):
    store = open_store(store_url)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(2))
        ck.save(2, tagged_state(3))
    own = sorted(manifest_chunks(store, 2) - manifest_chunks(store, 1))
    key = own[0] if target == "chunk" else fmt.manifest_key(RUN, 2)
    _damage(store, key, how)
    with Checkpointer(store_url, run=RUN, restore_rng=False) as ck:
        report = ck.verify(2)
        assert not report.ok and report.problems
        assert ck.verify(1).ok
        state = blank_state()
        result = ck.restore(state)
        assert result.step == 1 and state_tag(state) == 2
        assert [s for s, _ in result.skipped] == [2]
        name = key if target == "manifest" else key.rsplit("/", 1)[-1][:16]
        assert name in result.skipped[0][1]
        with pytest.raises(NoValidCheckpointError):
            ck.restore(blank_state(), step=2)


# ---- crash at every store operation --------------------------------------------------------
@pytest.mark.parametrize(
    "store_url", ["local", pytest.param("s3", marks=pytest.mark.slow)], indirect=True
)  # on S3 (~20 s each): make test-e2e
@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_at_every_store_operation(store_url, when):
    """Every mutating operation of an incremental save fails in turn (and everything after
    it, as in a crashed process): the store's newest commit always restores whole."""

    def store_with_a(name: str):
        store = open_store(sub_url(store_url, name))
        with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
            ck.save(1, tagged_state(1))
        return store

    fs = FaultyStore(store_with_a("dry"))
    with Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(2, tagged_state(2), kind="incremental")
    ops = fs.mutating_log()
    assert ops[-2][1:] == ("put_if_absent", fmt.manifest_key(RUN, 2))
    assert ops[-1][1] == "delete" and ops[-1][2].startswith(leases.LEASES)  # the lease, held until the commit
    assert any(op == "touch" for _, op, _ in ops)  # the shared tensor was deduplicated
    for n in range(len(ops)):
        inner = store_with_a(f"crash-{n}")
        fs = FaultyStore(inner)
        fs.arm(n, when=when)
        released = n == len(ops) - 1  # the lease's release, after the commit: logged, and the save stands
        with Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
            with contextlib.nullcontext() if released else pytest.raises(InjectedFault):
                ck.save(2, tagged_state(2), kind="incremental")
        committed = released or (when == "after" and n == len(ops) - 2)
        with Checkpointer(inner, run=RUN, restore_rng=False) as fresh:
            state = blank_state()
            result = fresh.restore(state)
            assert (result.step, state_tag(state)) == ((2, 2) if committed else (1, 1)), f"crash at op {n} {ops[n]}"
            assert fresh.verify(1).ok


def test_read_failure_at_every_restore_operation_never_loads_a_mix(store_url):
    """One read error at each read of a restore: the newest checkpoint or a clean failure
    that leaves the state untouched; never a fallback past a checkpoint it could not read
    (a failed read proves no damage), never a state mixing two checkpoints."""
    store = open_store(store_url)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2), kind="incremental")
    fs = FaultyStore(store, count_reads=True)
    with Checkpointer(fs, run=RUN, restore_rng=False, threads=4) as ck:
        ck.restore(blank_state())
        total = fs.ops
        for n in range(total):
            fs.reset_counts()
            fs.arm(n, sticky=False)
            state = blank_state()
            try:
                result = ck.restore(state)
            except StoreUnavailableError as e:
                assert "injected fault" in str(e)
                assert state["epoch"] is None and state["z"].eq(-7).all()  # untouched
                continue
            assert result.step == 2 and state_tag(state) == 2
    assert total >= 8


# ---- garbage collection --------------------------------------------------------------------
def test_gc_after_retention_deletes_exactly_the_unreferenced(store_url):
    store = open_store(store_url)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        for step in range(1, 5):
            ck.save(step, tagged_state(step), kind="full" if step % 2 else "incremental")
    records = rank_files(store, RUN, 1) | rank_files(store, RUN, 2)
    for step in (1, 2):  # what a retention policy would expire
        store.delete(fmt.manifest_key(RUN, step))
    live = manifest_chunks(store, 3) | manifest_chunks(store, 4)
    expected = (chunk_keys(store) - live) | records
    now = time.time() + 5
    dry = gc(store, grace=0, dry_run=True, now=now)
    assert {k for k, _ in dry.deleted} == expected and dry.live_manifests == 2
    real = gc(store, grace=0, now=now)
    assert sorted(real.deleted) == sorted(dry.deleted)
    assert chunk_keys(store) == live
    assert gc(store, grace="1h").deleted == []
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        for step in (3, 4):
            state = blank_state()
            assert ck.verify(step).ok and ck.restore(state, step=step).step == step and state_tag(state) == step


def test_gc_sweeps_nothing_of_a_save_about_to_commit(store_url):
    """Its lease, held until the commit, keeps even a grace-0 GC away (``wait=0``: it skips)."""
    inner = open_store(store_url)
    with Checkpointer(inner, run=RUN, chunk_bytes=CHUNK, threads=4) as ck:
        ck.save(1, tagged_state(1))
    fs = FaultyStore(inner)
    pause = fs.pause_before("put_if_absent", lambda key: key == fmt.manifest_key(RUN, 2))
    outcome: list = []
    ck = Checkpointer(fs, run=RUN, chunk_bytes=CHUNK, threads=4)
    saver = threading.Thread(target=lambda: outcome.append(ck.save(2, tagged_state(2), kind="incremental")))
    saver.start()
    try:
        assert pause.reached.wait(30), "the save never reached its commit"
        report = gc(inner, grace=0, now=time.time() + 2, wait=0)
    finally:
        pause.release()
        saver.join(30)
    ck.close()
    assert report.deleted == [] and report.skipped and outcome and outcome[0].step == 2
    with Checkpointer(inner, run=RUN, restore_rng=False) as fresh:
        state = blank_state()
        assert fresh.verify(2).ok and fresh.restore(state).step == 2 and state_tag(state) == 2
    assert chunk_keys(inner) == manifest_chunks(inner, 1) | manifest_chunks(inner, 2)
