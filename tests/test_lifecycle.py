"""Lifecycle operations in the library: verdict records, compress, archive, expire, inventory."""

import torch

from ckptflow import Checkpointer, catalog, inventory, lifecycle
from ckptflow import format as fmt
from ckptflow.store import open_store


def make(tmp_path, steps=(1, 2)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        for step in steps:
            with torch.no_grad():
                model[1].weight.add_(0.01)
            ck.save(step, {"model": model}, metadata={"train_loss": 1.0 / step})
    return open_store(root), model


def test_compress_is_verified_idempotent_and_keeps_restores_exact(tmp_path):
    store, model = make(tmp_path)
    first = lifecycle.compress(store, "r", 2)
    assert first.reencoded > 0 and first.bytes_after < first.bytes_before and first.ratio > 1
    assert lifecycle.compress(store, "r", 2).reencoded == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with Checkpointer(store, "r") as ck:
        assert ck.restore({"model": fresh}).step == 2
        assert ck.verify(1).ok  # step 1 shares re-encoded chunks
    assert torch.equal(fresh[1].weight, model[1].weight)


def test_archive_copies_commit_last_and_verifies_there(tmp_path):
    store, _ = make(tmp_path)
    dst = open_store(str(tmp_path / "archive"))
    report = lifecycle.archive(store, dst, "r", 1)
    assert report.ok and report.chunks_copied > 0
    again = lifecycle.archive(store, dst, "r", 2)
    assert again.ok and again.chunks_present > 0  # shared chunks are not copied twice
    assert [i.step for i in catalog.list_checkpoints(dst, "r")] == [1, 2]
    dst.replace(fmt.rank_key("r", 1, 0), b"{}")  # a different record already there is reported, not overwritten
    assert not lifecycle.archive(store, dst, "r", 1).ok


def test_records_expire_and_inventory(tmp_path):
    store, _ = make(tmp_path, steps=(1, 2, 3))
    lifecycle.validate(store, "r", 1)
    lifecycle.write_record(store, "r", 2, "evaluation", {"metrics": {"val_loss": 0.5}})
    records = lifecycle.all_records(store)
    assert records[("r", 1)]["validation"]["ok"] is True and ("r", 3) not in records
    entries = {e.step: e for e in inventory.collect(store)}
    assert entries[1].validation == "passed" and entries[2].validation == "not checked"
    assert entries[2].metrics == {"train_loss": 0.5, "val_loss": 0.5}
    rows = inventory.rows(list(entries.values()), inventory.retention_plan(list(entries.values()), now=0.0))
    assert [r["retention"].split(":")[0] for r in rows] == ["keep", "keep", "keep"]

    deleted = lifecycle.expire(store, "r", 1)
    assert fmt.manifest_key("r", 1) == deleted[0]
    assert not store.exists(fmt.manifest_key("r", 1)) and lifecycle.read_record(store, "r", 1, "validation") is None
    assert [i.step for i in catalog.list_checkpoints(store, "r")] == [2, 3]


def test_archive_copy_must_match_and_have_verified_before_a_hot_copy_expires(tmp_path):
    store, _ = make(tmp_path)
    dst = open_store(str(tmp_path / "archive"))
    assert "has not verified" in inventory.archive_copy_matches(store, dst, "r", 1)
    report = lifecycle.archive(store, dst, "r", 1)
    lifecycle.write_record(store, "r", 1, "archive", {"url": dst.url, "ok": report.ok})
    assert inventory.archive_copy_matches(store, dst, "r", 1) is None
    assert "archived to" in inventory.archive_copy_matches(store, open_store(str(tmp_path / "other")), "r", 1)
    lifecycle.write_record(store, "r", 2, "archive", {"url": dst.url, "ok": True})  # a record, but no copy
    assert "no manifest" in inventory.archive_copy_matches(store, dst, "r", 2)
    entries = {e.step: e for e in inventory.collect(store, dst)}
    assert entries[1].archived and not entries[2].archived and entries[1].tiers == ["hot", "archive"]
    lifecycle.expire(store, "r", 1, keep_records=True)  # hot copy only: its verdicts stay
    assert lifecycle.read_record(store, "r", 1, "archive")["ok"] is True
    assert [e.tiers for e in inventory.collect(store, dst) if e.step == 1] == [["archive"]]
