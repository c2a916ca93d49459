"""Lifecycle operations in the library: verdict records keyed by digest, compress, archive,
expire, inventory."""

import threading

import pytest
import torch

from ckptflow import Checkpointer, ExpireError, PromotionError, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.gc import gc
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.policy.retention import KeepNewestValid
from ckptflow.reports import inventory
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte, manifest_path, only_in
from support.faulty_store import FaultyStore


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


def test_compress_verifies_the_chunks_it_leaves_in_their_codec(tmp_path):
    """A second compaction rewrites nothing (every chunk is zstd already), yet it still
    verifies every chunk: one that rotted since is reported, and nothing is rewritten."""
    store, _ = make(tmp_path)
    assert lifecycle.compress(store, "r", 2).reencoded > 0
    digest = max(catalog.read_manifest(store, "r", 2).chunks)
    path = chunk_path(store.root, digest)
    flip_byte(path)
    damaged = path.read_bytes()
    with pytest.raises(CkptflowError, match=digest[:16]):
        lifecycle.compress(store, "r", 2)
    assert path.read_bytes() == damaged


def test_archive_copies_commit_last_and_verifies_there(tmp_path):
    store, _ = make(tmp_path)
    dst = open_store(str(tmp_path / "archive"))
    report = lifecycle.archive(store, dst, "r", 1)
    assert report.ok and report.chunks_copied > 0
    again = lifecycle.archive(store, dst, "r", 2)
    assert again.ok and again.chunks_present > 0  # shared chunks are not copied twice
    assert [i.step for i in catalog.list_checkpoints(dst, "r")] == [1, 2]
    dst.replace(
        catalog.read_manifest(store, "r", 1).rank_key(0), b"{}"
    )  # a different record already there is reported, not overwritten
    assert not lifecycle.archive(store, dst, "r", 1).ok


def test_records_a_failed_lossy_archival_left_do_not_block_an_exact_one(tmp_path):
    """A lossy archival that wrote its rank records and died before its manifest committed
    leaves records no restore reads; an exact archival of the same step replaces them (no
    manifest names them) and commits a copy that restores bit for bit."""
    from ckptflow.chunks.lossy import ArchiveCodec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    with Checkpointer(str(tmp_path / "store"), "r", chunk_bytes=4096) as ck:
        ck.save(2, {"model": model, "optim": optim})
    store, dst = open_store(str(tmp_path / "store")), open_store(str(tmp_path / "archive"))
    assert lifecycle.archive(store, dst, "r", 2, codec=ArchiveCodec.parse("weights=bf16,optimizer=drop")).ok
    lossy_record = dst.get(catalog.read_manifest(dst, "r", 2).rank_key(0))
    dst.delete(fmt.manifest_key("r", 2))  # as if that archival died right before its commit
    hot = catalog.read_manifest(store, "r", 2)
    assert dst.get(hot.rank_key(0)) == lossy_record != store.get(hot.rank_key(0))
    report = lifecycle.archive(store, dst, "r", 2)
    assert report.ok, report.problems
    assert catalog.read_manifest(dst, "r", 2).digest == hot.digest
    assert dst.get(hot.rank_key(0)) == store.get(hot.rank_key(0))
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with Checkpointer(str(tmp_path / "archive"), "r") as ck:
        assert ck.restore({"model": fresh}).step == 2
    assert torch.equal(fresh[1].weight, model[1].weight)


def test_an_archive_tier_that_could_not_be_read_back_raises_and_records_no_failed_copy(tmp_path):
    store, _ = make(tmp_path)
    dst = FaultyStore(open_store(str(tmp_path / "archive")))

    def outage(op, key):
        if op == "get" and key.startswith("chunks/"):
            raise StoreUnavailableError(f"S3 GetObject of {dst.url}/{key} failed after 10 attempts: SlowDown")
        return False

    dst.fail_if = outage
    with pytest.raises(StoreUnavailableError, match="could not verify the archive copy of run r step 1"):
        lifecycle.archive(store, dst, "r", 1)
    assert lifecycle.read_record(store, subject(store, 1), "archive") is None  # no verdict: archival retries
    dst.fail_if = lambda op, key: False
    assert lifecycle.archive(store, dst, "r", 1).ok


def subject(store, step, run="r"):
    return lifecycle.Subject.of(catalog.read_manifest(store, run, step))


def test_records_expire_and_inventory(tmp_path):
    store, _ = make(tmp_path, steps=(1, 2, 3))
    lifecycle.validate(store, "r", 1)
    lifecycle.write_record(store, subject(store, 2), "evaluation", {"metrics": {"val_loss": 0.5}})
    records = lifecycle.records_by_subject(store)
    assert records[("r", 1, subject(store, 1).digest)]["validation"]["ok"] is True
    assert not any(key[:2] == ("r", 3) for key in records)
    entries = {e.step: e for e in inventory.collect(store)}
    assert entries[1].validation == "passed" and entries[2].validation == "not checked"
    assert entries[2].metrics == {"train_loss": 0.5, "val_loss": 0.5}
    rows = inventory.rows(list(entries.values()), inventory.retention_plan(list(entries.values()), now=0.0))
    assert [r["retention"].split(":")[0] for r in rows] == ["keep", "keep", "keep"]

    gone = subject(store, 1)
    deleted = lifecycle.expire(store, "r", 1)
    assert fmt.manifest_key("r", 1) == deleted[0]
    assert not store.exists(fmt.manifest_key("r", 1)) and lifecycle.read_record(store, gone, "validation") is None
    assert [i.step for i in catalog.list_checkpoints(store, "r")] == [2, 3]


def test_a_step_committed_again_shows_its_own_verdict(tmp_path):
    """Corrupt step 2, restore falls back to 1, save step 2 again: the new step 2 verifies
    and the inventory and retention see it as valid (the old verdict is history)."""
    store, model = make(tmp_path, steps=(1, 2))
    old = subject(store, 2)
    for digest in sorted(
        set(catalog.read_manifest(store, "r", 2).chunks) - set(catalog.read_manifest(store, "r", 1).chunks)
    ):
        flip_byte(chunk_path(store.root, digest))
    assert lifecycle.validate(store, "r", 2)["ok"] is False
    assert {e.step: e.validation for e in inventory.collect(store)}[2] == "failed"
    with Checkpointer(store, "r") as ck:
        assert ck.restore({"model": model}).step == 1
        ck.save(2, {"model": model}, metadata={"train_loss": 0.4})
    new = subject(store, 2)
    assert new.digest != old.digest
    entry = {e.step: e for e in inventory.collect(store)}[2]
    assert entry.validation == "not checked" and entry.digest == new.digest  # the old verdict is not this commit's
    assert lifecycle.validate(store, "r", 2)["ok"] is True
    entry = {e.step: e for e in inventory.collect(store)}[2]
    assert entry.validation == "passed" and entry.valid is True
    plan = inventory.retention_plan(inventory.collect(store), now=1e12, policy=KeepNewestValid())
    assert ("r", 2) in plan.keep and "newest valid" in plan.keep[("r", 2)][0]
    assert lifecycle.read_record(store, old, "validation")["ok"] is False  # history stays readable


def test_archive_copy_must_match_and_have_verified_before_a_hot_copy_expires(tmp_path):
    store, _ = make(tmp_path)
    dst = open_store(str(tmp_path / "archive"))
    assert "has not verified" in lifecycle.copy_matches(store, dst, "r", 1)
    assert lifecycle.archive(store, dst, "r", 1).ok  # records its own verdict
    assert lifecycle.copy_matches(store, dst, "r", 1) is None
    assert "archived to" in lifecycle.copy_matches(store, open_store(str(tmp_path / "other")), "r", 1)
    lifecycle.write_record(store, subject(store, 2), "archive", {"url": dst.url, "ok": True})  # a record, but no copy
    assert "no manifest" in lifecycle.copy_matches(store, dst, "r", 2)
    entries = {e.step: e for e in inventory.collect(store, dst)}
    assert entries[1].archived and not entries[2].archived and entries[1].tiers == ["hot", "archive"]
    first = subject(store, 1)
    lifecycle.expire(store, "r", 1, keep_records=True)  # hot copy only: its verdicts stay
    assert lifecycle.read_record(store, first, "archive")["ok"] is True
    assert [e.tiers for e in inventory.collect(store, dst) if e.step == 1] == [["archive"]]


def test_expire_raises_when_a_delete_fails_and_gc_finishes_it(tmp_path):
    """Once the commit record went, nothing tells the expired commit's leftover rank record
    from one of a save of that step in flight: a second expiry leaves it, and GC (past its
    grace period) deletes it."""
    store, _ = make(tmp_path)
    faulty = FaultyStore(store)
    record = catalog.read_manifest(store, "r", 1).rank_key(0)
    faulty.fail_if = lambda op, key: op == "delete" and key == record
    with pytest.raises(ExpireError, match="could not be deleted.*GC its rank records"):
        lifecycle.expire(faulty, "r", 1)
    assert not store.exists(fmt.manifest_key("r", 1)) and store.exists(record)
    faulty.fail_if = lambda op, key: False
    assert lifecycle.expire(faulty, "r", 1) == [] and store.exists(record)  # found no commit: deleted nothing
    assert (record, store.stat(record).size) in gc(store, grace="0s").deleted and not store.exists(record)
    faulty.fail_if = lambda op, key: op == "delete" and key.endswith("manifest.json")
    with pytest.raises(ExpireError, match="still exists"):
        lifecycle.expire(faulty, "r", 2)
    assert [i.step for i in catalog.list_checkpoints(store, "r")] == [2]


def test_expiring_a_damaged_commit_leaves_the_valid_one_a_save_made_meanwhile(tmp_path):
    """Retention expires a damaged checkpoint; between the expiry's read of the commit record
    and its delete, the job saves that step again (the damaged manifest to quarantine, a
    valid one committed). The expiry refuses instead of deleting the new commit."""
    store, model = make(tmp_path, steps=(1,))
    flip_byte(manifest_path(store.root, "r", 1), 10)
    faulty = FaultyStore(store)
    pause = faulty.pause_before("delete", lambda key: key == fmt.manifest_key("r", 1))
    outcome: list = []
    expiry = threading.Thread(target=lambda: outcome.append(_raised(lambda: lifecycle.expire(faulty, "r", 1))))
    expiry.start()
    assert pause.reached.wait(30)
    with Checkpointer(store, "r", chunk_bytes=4096) as ck:
        ck.save(1, {"model": model})
    saved = catalog.read_manifest(store, "r", 1)
    pause.release()
    expiry.join(30)
    [error] = outcome
    assert isinstance(error, ExpireError) and "committed again" in str(error)
    assert catalog.read_manifest(store, "r", 1).digest == saved.digest
    assert all(store.exists(key) for key in saved.rank_keys())


def test_expiring_a_damaged_commit_keeps_the_records_of_a_save_of_that_step_in_flight(tmp_path):
    """The job saves a damaged step again; retention expires the damaged commit after the
    save wrote its rank records and before it commits. The expiry deletes the damaged
    commit and its own records only: the save commits and restores exactly."""
    store, model = make(tmp_path, steps=(1,))
    old_records = [i.key for i in store.list(fmt.step_prefix("r", 1)) if "/ranks/" in i.key]
    flip_byte(manifest_path(store.root, "r", 1), 10)
    faulty = FaultyStore(store)
    pause = faulty.pause_before("put_if_absent", lambda key: key == fmt.manifest_key("r", 1))
    with torch.no_grad():
        model[0].weight.mul_(2)
    saving = threading.Thread(target=lambda: _save(faulty, model))
    saving.start()
    assert pause.reached.wait(30)
    try:
        deleted = lifecycle.expire(store, "r", 1)
    finally:
        pause.release()
        saving.join(30)
    assert deleted == [fmt.manifest_key("r", 1), *old_records]
    saved = catalog.read_manifest(store, "r", 1)
    assert all(store.exists(key) for key in saved.rank_keys())
    restored = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with Checkpointer(store, "r") as ck:
        assert ck.restore({"model": restored}).step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))


def _save(store, model):
    with Checkpointer(store, "r", chunk_bytes=4096) as ck:
        ck.save(1, {"model": model})


def _raised(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_evaluate_without_an_evaluator_uses_the_trainers_metrics_and_flags_overfitting(tmp_path):
    root = str(tmp_path / "store")
    model = torch.nn.Linear(4, 2)
    with Checkpointer(root, "r") as ck:  # train loss keeps falling, validation loss turns up at step 3
        for step, (train, val) in enumerate([(1.0, 0.9), (0.8, 0.7), (0.6, 0.75)], start=1):
            ck.save(step, {"model": model}, metadata={"train_loss": train, "val_loss": val, "note": "x"})
    store = open_store(root)
    first = lifecycle.evaluate(store, store, "r", 1)
    assert first["metrics"] == {"train_loss": 1.0, "val_loss": 0.9} and first["source"] == "trainer"
    assert first["previous_step"] is None and first["overfitting"] is None
    second = lifecycle.evaluate(store, store, "r", 2)
    assert (
        second["previous_step"] == 1 and second["improvement"] == pytest.approx(0.2) and second["overfitting"] is False
    )
    third = lifecycle.evaluate(store, store, "r", 3)
    assert third["improvement"] == pytest.approx(-0.05) and third["overfitting"] is True
    scored = lifecycle.evaluate(
        store, store, "r", 3, lambda sd, info: {"val_loss": float(sd["weight"].numel())}, evaluator_name="count:weights"
    )
    assert scored["metrics"] == {"val_loss": 8.0} and scored["evaluator"] == "count:weights"
    assert lifecycle.read_record(store, subject(store, 3), "evaluation")["metrics"] == {"val_loss": 8.0}


def test_improvement_compares_with_an_older_steps_current_commit_by_the_same_evaluator(tmp_path):
    """Step 2 evaluated (commit A), then committed again (B, not evaluated yet): step 3
    compares with step 1, not with A. Scored by another evaluator than step 1's, it has
    no improvement figure until step 1 is scored by that evaluator too."""
    root = str(tmp_path / "store")
    model = torch.nn.Linear(4, 2)
    with Checkpointer(root, "r") as ck:
        for step, val in ((1, 0.9), (2, 0.7)):
            ck.save(step, {"model": model}, metadata={"val_loss": val})
    store = open_store(root)
    lifecycle.evaluate(store, store, "r", 1)
    assert lifecycle.evaluate(store, store, "r", 2)["improvement"] == pytest.approx(0.2)
    lifecycle.expire(store, "r", 2, keep_records=True)
    with Checkpointer(root, "r") as ck:
        for step, val in ((2, 0.5), (3, 0.4)):
            ck.save(step, {"model": model}, metadata={"val_loss": val})
    third = lifecycle.evaluate(store, store, "r", 3)
    assert (third["previous_step"], third["improvement"]) == (1, pytest.approx(0.5))

    def by_step(state_dict, info):
        return {"val_loss": 1.0 / info["step"]}

    scored = lifecycle.evaluate(store, store, "r", 3, by_step, evaluator_name="team.eval:by_step")
    assert (scored["previous_step"], scored["improvement"], scored["overfitting"]) == (None, None, None)
    lifecycle.evaluate(store, store, "r", 1, by_step, evaluator_name="team.eval:by_step")
    scored = lifecycle.evaluate(store, store, "r", 3, by_step, evaluator_name="team.eval:by_step")
    assert (scored["previous_step"], scored["improvement"]) == (1, pytest.approx(1.0 - 1.0 / 3))


def test_a_bad_promotion_request_writes_nothing(tmp_path):
    store, _ = make(tmp_path)
    registry = Registry(store)
    for bad in ({"stage": "production"}, {"dtype": "int4"}, {"mode": "best"}, {"key": ""}):
        with pytest.raises(PromotionError, match="before anything was written"):
            PromotionRequest("m", ("r", 2), **bad)
    with pytest.raises(PromotionError, match="failed validation"):
        flip_byte(chunk_path(store.root, only_in(store.root, "r", 2, 1)[0]))
        promote(store, registry, PromotionRequest("m", ("r", 2), stage="stable"))
    assert registry.models() == [] and not list(store.list("registry/"))
    version = promote(store, registry, PromotionRequest("m", ("r", 1), stage="stable")).registered
    assert registry.aliases("m") == {"latest": version.version, "stable": version.version}
    assert version.partition_key == "r@1" and version.manifest_digest == subject(store, 1).digest
