"""Promotion and retention exclude each other (``ckptflow.chunks.leases.PROMOTIONS``): a
retention never expires the checkpoint that a promotion in flight is publishing, whichever
of the two starts first, and a promotion never registers a version whose source a
retention expired meanwhile. Each test holds one side at a real point of its work (a
threading.Event inside the upload or the expiry) while the other runs for real."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle, open_store
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.chunks import leases
from ckptflow.errors import CkptflowError, ObjectNotFoundError, PromotionError, RetentionError
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle import retention_apply
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.policy.retention import DAY, AnyOf

LATER = time.time() + 100 * DAY  # every checkpoint is old; AnyOf(()) keeps only the newest valid


@pytest.fixture
def hot(tmp_path):
    root = str(tmp_path / "hot")
    with Checkpointer(root, "r") as ck:
        for step in (1, 2, 3):
            torch.manual_seed(step)
            ck.save(step, {"model": nn.Linear(16, 16)}, metadata={"val_loss": 1.0 / step})
    return open_store(root)


def a_plan(hot):
    _, plan = lifecycle.current_plan(hot, None, Registry(hot), AnyOf(()), now=LATER)
    assert set(plan.delete) == {("r", 1), ("r", 2)}
    return plan


class Paused:
    """Wraps ``function``: the first call signals ``reached`` and waits for ``release``."""

    def __init__(self, function):
        self.function, self.reached, self.release = function, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        if not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(60)
        return self.function(*args, **kwargs)


def test_retention_waits_for_a_promotion_in_flight_then_keeps_what_it_published(hot):
    plan = a_plan(hot)
    registry = Registry(hot)
    registry.upload = upload = Paused(registry.upload)  # exported; not registered yet
    with ThreadPoolExecutor(2) as pool:
        promoting = pool.submit(promote, hot, registry, PromotionRequest("m", ("r", 1), stage="stable"))
        assert upload.reached.wait(60)
        with pytest.raises(RetentionError, match=r"1 promotion\(s\) are publishing .* nothing was expired"):
            lifecycle.apply_retention(hot, None, plan, registry=Registry(hot), wait=0.3)
        assert {read_manifest(hot, "r", s).step for s in (1, 2)} == {1, 2}
        retaining = pool.submit(lifecycle.apply_retention, hot, None, plan, registry=Registry(hot), wait=60)
        time.sleep(0.3)
        assert not retaining.done()  # it waits for the promotion
        upload.release.set()
        version = promoting.result(60).registered
        report = retaining.result(60)
    assert report.expired == [("r", 2)]
    [(ref, why)] = report.changed
    assert ref == ("r", 1) and "published" in why
    assert read_manifest(hot, "r", 1).digest == version.manifest_digest
    assert not list(hot.list(leases.PROMOTIONS.leases)) and not hot.exists(leases.PROMOTIONS.lock)


def test_a_promotion_waits_for_retention_then_refuses_the_checkpoint_it_expired(hot, monkeypatch):
    plan = a_plan(hot)
    expire = Paused(retention_apply.expire)
    monkeypatch.setattr(retention_apply, "expire", expire)
    registry = Registry(hot)
    with ThreadPoolExecutor(2) as pool:
        retaining = pool.submit(lifecycle.apply_retention, hot, None, plan, registry=registry, wait=60)
        assert expire.reached.wait(60)
        with pytest.raises(PromotionError, match="retention has held .* try the promotion again"):
            promote(hot, registry, PromotionRequest("m", ("r", 1)), wait=0.3)
        promoting = pool.submit(promote, hot, registry, PromotionRequest("m", ("r", 1)), wait=60)
        time.sleep(0.3)
        assert not promoting.done()  # it waits for the retention
        expire.release.set()
        assert retaining.result(60).expired == [("r", 1), ("r", 2)]
        with pytest.raises(CkptflowError, match="000000000001.* never committed .*or was deleted"):
            promoting.result(60)
    assert registry.versions("m") == [] and registry.pinned() == set()


def test_a_promotion_arriving_while_retention_waits_lets_it_go_on(hot):
    """Retention holds its lock and waits for promotion 1; promotion 2 arrives meanwhile.
    It waits for the retention without a lease (the retention would wait for it: both
    stalled until a timeout), so the retention goes on as soon as promotion 1 is done."""
    plan = a_plan(hot)
    registry = Registry(hot)
    registry.upload = upload = Paused(registry.upload)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(promote, hot, registry, PromotionRequest("m", ("r", 3), stage="stable"))
        assert upload.reached.wait(60)
        retaining = pool.submit(lifecycle.apply_retention, hot, None, plan, registry=Registry(hot), wait=60)
        while not hot.exists(leases.PROMOTIONS.lock):
            time.sleep(0.01)
        second = pool.submit(promote, hot, Registry(hot), PromotionRequest("m", ("r", 1)), wait=60)
        time.sleep(0.5)  # it has found the lock held
        upload.release.set()
        first.result(60)
        released = time.monotonic()
        report = retaining.result(60)
        assert time.monotonic() - released < 10  # not the wait's 60 s
        assert report.expired == [("r", 1), ("r", 2)]
        with pytest.raises(CkptflowError, match="000000000001.* never committed"):
            second.result(60)  # then it found step 1 expired
    assert [v.step for v in registry.versions("m")] == [3]


def test_another_retention_holding_the_lock_expires_nothing(hot):
    plan = a_plan(hot)
    with leases.exclusive_lock(hot, leases.PROMOTIONS):
        with pytest.raises(RetentionError, match="another retention holds"):
            lifecycle.apply_retention(hot, None, plan, registry=Registry(hot))
    assert {read_manifest(hot, "r", s).step for s in (1, 2)} == {1, 2}
    assert lifecycle.apply_retention(hot, None, plan, registry=Registry(hot)).expired == [("r", 1), ("r", 2)]


def test_a_promotion_that_died_holding_its_lease_blocks_no_retention(hot):
    key = f"{leases.PROMOTIONS.leases}dead.json"
    hot.put_if_absent(key, b'{"what": "promotion"}')
    then = time.time() - 2 * leases.DEAD_AFTER  # never renewed since
    os.utime(os.path.join(hot.root, *key.split("/")), (then, then))
    report = lifecycle.apply_retention(hot, None, a_plan(hot), registry=Registry(hot), wait=0.3)
    assert report.expired == [("r", 1), ("r", 2)]
    with pytest.raises(ObjectNotFoundError):
        hot.stat(key)


def test_a_promotion_whose_lease_lapsed_registers_nothing(hot, monkeypatch):
    """A promotion stalled past ``DEAD_AFTER`` (its store did not answer the renewals) may
    have been taken for dead by a retention: it must not register what may be gone."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 0.5)
    registry = Registry(hot)
    real_upload = registry.upload

    def upload_then_lose_the_lease(*args, **kwargs):
        files = real_upload(*args, **kwargs)
        for info in hot.list(leases.PROMOTIONS.leases):
            hot.delete(info.key)  # what a retention does with a lease it found dead
        time.sleep(0.3)  # the next renewal finds it gone
        return files

    registry.upload = upload_then_lose_the_lease
    with pytest.raises(CkptflowError, match="lease .* could not be renewed.* nothing was registered"):
        promote(hot, registry, PromotionRequest("m", ("r", 1)))
    assert registry.versions("m") == []


def test_a_retention_refused_for_a_promotion_says_the_lease_timing_in_force(hot, monkeypatch):
    """As GC's skip: the refusal named ``DEAD_AFTER`` as imported (30 s), not as set when
    the leases were listed."""
    monkeypatch.setattr(leases, "DEAD_AFTER", 8.0)
    with leases.shared_lease(hot, leases.PROMOTIONS, 10.0):
        with pytest.raises(RetentionError, match=r"renewed within the last 8 s\) after 0 s; nothing was expired"):
            lifecycle.apply_retention(hot, None, a_plan(hot), registry=Registry(hot), wait=0)
    assert {read_manifest(hot, "r", s).step for s in (1, 2)} == {1, 2}
