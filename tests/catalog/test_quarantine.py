"""A rejected manifest is moved aside before its step is saved again: kept under its own
digest, and never deleted unless the copy holds its bytes."""

from __future__ import annotations

import time

import pytest
import torch

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from support.corrupt import flip_byte, manifest_path
from support.faulty_store import FaultyStore, InjectedFault

RUN = "r"


def save_rejected(root, step: int, value: float) -> bytes:
    """Commit ``step``, then damage its manifest so the next save of the step rejects it."""
    with Checkpointer(root, RUN) as ck:
        ck.save(step, {"w": torch.full((8,), value)})
    flip_byte(manifest_path(root, RUN, step), 40)
    return manifest_path(root, RUN, step).read_bytes()


def quarantined(root) -> dict[str, bytes]:
    store = open_store(root)
    return {i.key: store.get(i.key) for i in store.list(f"runs/{RUN}/quarantine/")}


def test_two_rejections_of_one_step_in_the_same_second_keep_both_manifests(tmp_path, monkeypatch):
    root = str(tmp_path / "store")
    now = time.gmtime()
    monkeypatch.setattr(time, "gmtime", lambda *_: now)  # both within one second, however slow the machine
    first = save_rejected(root, 5, 1.0)
    second = save_rejected(root, 5, 2.0)  # saving step 5 again moved the first aside
    with Checkpointer(root, RUN) as ck:
        ck.save(5, {"w": torch.full((8,), 3.0)})
    kept = quarantined(root)
    assert sorted(kept.values()) == sorted([first, second])
    assert set(kept) == {fmt.quarantine_key(RUN, 5, fmt.digest_of(blob)) for blob in (first, second)}
    assert catalog.read_manifest(open_store(root), RUN, 5).step == 5


def test_a_copy_that_cannot_be_written_leaves_the_manifest(tmp_path):
    root = str(tmp_path / "store")
    damaged = save_rejected(root, 5, 1.0)
    store = FaultyStore(open_store(root))
    store.fail_if = lambda op, key: "/quarantine/" in key and op in ("put_if_absent", "replace")
    with Checkpointer(store, RUN) as ck, pytest.raises(InjectedFault):
        ck.save(5, {"w": torch.full((8,), 2.0)})
    assert manifest_path(root, RUN, 5).read_bytes() == damaged and quarantined(root) == {}


def test_a_damaged_copy_already_in_quarantine_is_replaced_before_the_manifest_goes(tmp_path):
    root = str(tmp_path / "store")
    damaged = save_rejected(root, 5, 1.0)
    key = fmt.quarantine_key(RUN, 5, fmt.digest_of(damaged))
    open_store(root).put_if_absent(key, b"not the manifest")
    with Checkpointer(root, RUN) as ck:
        ck.save(5, {"w": torch.full((8,), 2.0)})
    assert quarantined(root) == {key: damaged}
