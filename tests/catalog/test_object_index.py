"""Listing-validated indexes: a store already known costs one read per run, and the
objects stay the truth."""

from __future__ import annotations

import os
import time
from dataclasses import fields

import pytest
import torch

from ckptflow import Checkpointer, lifecycle, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.listing import Problem
from ckptflow.catalog.object_index import PREFIX, ObjectIndex, record_value
from ckptflow.catalog.records import SMALL_RECORD_BYTES
from ckptflow.format import layout as fmt
from ckptflow.format.sealed import unseal
from support.corrupt import flip_byte, manifest_path
from support.faulty_store import FaultyStore

RUN = "r"


def saved(root, steps) -> None:
    with Checkpointer(root, RUN) as ck:
        for step in steps:
            ck.save(step, {"w": torch.full((8,), float(step))}, metadata={"loss": 1.0 / step})


def reads(store: FaultyStore, fn) -> list[str]:
    store.reset_counts()
    fn()
    return [key for _, op, key in store.log if op == "get"]


def test_a_known_store_costs_one_read_per_run_and_new_commits_are_read(tmp_path):
    root = str(tmp_path / "store")
    saved(root, range(1, 21))
    store = FaultyStore(open_store(root), count_reads=True)
    first = reads(store, lambda: list(catalog.summaries(store)))
    assert sum(k.endswith("manifest.json") for k in first) == 20
    again = reads(store, lambda: list(catalog.summaries(store)))
    assert again == [f"{PREFIX}runs/{RUN}.json"]
    saved(root, [21])
    third = reads(store, lambda: [i.step for i in catalog.summaries(store)])
    assert [k for k in third if k.endswith("manifest.json")] == [fmt.manifest_key(RUN, 21)]
    assert [i.step for i in catalog.list_checkpoints(store, RUN)] == list(range(1, 22))


def test_the_objects_stay_the_truth(tmp_path):
    root = str(tmp_path / "store")
    saved(root, [1, 2])
    store = open_store(root)
    list(catalog.summaries(store))
    index = store.root + "/" + PREFIX + f"runs/{RUN}.json"
    with open(index, "r+b") as f:  # damaged: rebuilt from the manifests
        f.seek(20)
        f.write(b"\x00")
    assert [i.step for i in catalog.summaries(store)] == [1, 2]
    digest = catalog.read_manifest(store, RUN, 2).digest
    store.delete(fmt.manifest_key(RUN, 2))  # expired: gone from the listing, so from the answer
    assert [i.step for i in catalog.summaries(store)] == [1]
    saved(root, [2])  # committed again: a new manifest, read anew
    [_, again] = catalog.summaries(store)
    assert again.step == 2 and again.digest != digest


def test_lifecycle_records_are_read_once(tmp_path):
    root = str(tmp_path / "store")
    saved(root, range(1, 6))
    plain = open_store(root)
    for step in range(1, 6):
        lifecycle.validate(plain, RUN, step)
    store = FaultyStore(plain, count_reads=True)
    lifecycle.records_by_subject(store)
    again = reads(store, lambda: lifecycle.records_by_subject(store))
    assert again == [f"{PREFIX}lifecycle/{RUN}.json"]
    assert all(r["validation"]["ok"] for r in lifecycle.records_by_subject(store).values())


def test_an_older_ckptflow_does_not_take_an_index_of_summaries_it_cannot_build(tmp_path):
    """ckptflow before index schemas took any index of ``index_version`` 2 and built a
    ``CheckpointInfo`` of each value. This version's summaries hold ``added_bytes``, a field
    it does not have: on a store an upgraded orchestrator had indexed, the older trainer's
    ``Checkpointer.list``, ``ls`` and inventory raised TypeError (unexpected keyword
    argument 'added_bytes') for as long as the index stood."""
    root = str(tmp_path / "store")
    saved(root, [1, 2])
    store = open_store(root)
    list(catalog.summaries(store))
    doc = unseal(store.get(f"{PREFIX}runs/{RUN}.json"), "index")
    previous_fields = {f.name for f in fields(catalog.CheckpointInfo)} - {"added_bytes"}
    taken_by_previous = doc["index_version"] == 2  # all that reader checked
    assert not taken_by_previous or all(set(e[3]) <= previous_fields for e in doc["entries"].values())
    assert [i.added_bytes > 0 for i in catalog.summaries(store)] == [True, True]  # this version reads it


def test_a_manifest_rewritten_in_place_with_its_times_set_back_is_read_again(tmp_path):
    root = str(tmp_path / "store")
    saved(root, [1, 2])
    store = open_store(root)
    assert [i.step for i in catalog.list_checkpoints(store, RUN)] == [1, 2]
    path = manifest_path(root, RUN, 2)
    before = os.stat(path)
    flip_byte(path, 40)  # same size; the times set back as a careless copy or restore would
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert [i.step for i in catalog.list_checkpoints(store, RUN)] == [1]
    [problem] = [p for p in catalog.summaries(store, RUN) if isinstance(p, catalog.Problem)]
    assert problem.step == 2 and problem.kind == "corrupt"


def test_an_s3_object_rewritten_within_the_same_second_is_read_again(s3_store_url):
    """S3's LastModified has whole seconds: only the ETag tells two writes in one second apart."""
    saved(s3_store_url, [1])
    store = open_store(s3_store_url)
    key = fmt.manifest_key(RUN, 1)
    good = store.get(key)
    bad = bytearray(good)
    bad[40] ^= 1
    for _ in range(5):  # the three calls must fall within one second; a slow machine retries
        time.sleep(1 - time.time() % 1)
        store.replace(key, good)
        assert [i.step for i in catalog.list_checkpoints(store, RUN)] == [1]
        listed = store.stat(key).mtime
        store.replace(key, bytes(bad))
        if store.stat(key).mtime == listed:
            break
    else:
        pytest.skip("could not rewrite within one second of the listing")
    assert catalog.list_checkpoints(store, RUN) == []


def test_an_object_over_the_limit_is_refused_unread(tmp_path, monkeypatch):
    """A manifest larger than any record is a ``too_big`` problem before its bytes are read:
    ``ls`` read a 1.2 GB manifest whole (peak RSS 1.27 GB) before refusing it."""
    root = str(tmp_path / "store")
    saved(root, [1])
    monkeypatch.setattr(catalog, "MAX_RECORD_BYTES", 64)  # the real manifest is a few hundred bytes
    store = open_store(root)
    monkeypatch.setattr(store, "get", lambda key: pytest.fail(f"{key} was read whole"))
    (problem,) = catalog.summaries(store)
    assert isinstance(problem, Problem) and problem.kind == "too_big" and "more than the 64 expected" in problem.message


def test_a_run_index_written_when_it_kept_trainer_changes_is_rebuilt_without_them(tmp_path):
    """A run's lifecycle index written before it left a trainer record's changes out (up to
    1 MiB a step) kept them, entry by entry, for as long as the records stood: every read of
    the run (the inventory, retention, restore's selectors) loaded and handed them on, and
    a record landing beside them rewrote the index with them still in it."""
    store = open_store(str(tmp_path / "store"))
    for step in range(1, 5):
        subject = lifecycle.Subject(RUN, step, fmt.digest_of(b"commit %d" % step))
        changes = {"callbacks": {"EMA": "x" * (256 << 10)}}
        lifecycle.write_record(store, subject, "trainer", {"metrics": {"val_loss": 1.0 / step}, "changes": changes})
    whole = ObjectIndex(store, f"lifecycle/{RUN}", record_value, limit=SMALL_RECORD_BYTES)  # as it was written then
    whole.values(store.list("lifecycle/"))
    [old] = store.list(f"{PREFIX}lifecycle/")
    assert old.size > 1 << 20
    records = lifecycle.records_by_subject(store, RUN)
    assert [kinds["trainer"]["metrics"]["val_loss"] for _, kinds in sorted(records.items())] == [1, 0.5, 1 / 3, 0.25]
    assert all("changes" not in kinds["trainer"] for kinds in records.values())
    [new] = store.list(f"{PREFIX}lifecycle/")
    assert new.size < 16 << 10
