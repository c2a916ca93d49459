"""``Checkpointer.prepare``: host staging buffers allocated before the first async save,
so that save holds the loop only for the copy (measured by benchmarks/save_restore.py,
not here). What is tested: preparing writes nothing, refuses what a save would refuse,
and a prepared async save (and the next, training in between) restores exactly."""

from __future__ import annotations

import time

import pytest
import torch

from ckptflow import UnsupportedStateError
from ckptflow.chunks.io import ChunkStore
from support.states import assert_state_equals, snapshot


def test_prepare_writes_nothing_and_refuses_what_a_save_would(make_ck, tiny_state_factory, tmp_path):
    ck = make_ck()
    ck.prepare(tiny_state_factory(seed=1))
    assert not any((tmp_path / "store").rglob("*.json"))
    assert ck.list() == []
    with pytest.raises(UnsupportedStateError):
        ck.prepare({"model": tiny_state_factory()["model"], "bad": object()})


def test_prepared_async_saves_restore_exactly(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory(seed=2)
    ck = make_ck()
    ck.prepare(state)
    snaps = {}
    for step in (1, 2):
        tiny_train_step(state)
        handle = ck.save(step, state, blocking=False)
        snaps[step] = snapshot(state)
        tiny_train_step(state)  # the loop goes on while the save is written
        assert handle.wait().step == step
    for step in (1, 2):
        target = tiny_state_factory(seed=3)
        ck.restore(target, step=step)
        assert_state_equals(target, snaps[step])


def test_prepare_while_an_async_save_is_in_flight_leaves_that_save_as_it_was(make_ck, monkeypatch):
    """The staged buffers are the ones the save in flight writes from: ``prepare`` staged
    into them at once, so step 1 was committed holding the values the state had later."""
    put = ChunkStore.put
    monkeypatch.setattr(ChunkStore, "put", lambda self, *a, **k: (time.sleep(0.02), put(self, *a, **k))[1])
    state = {"w": torch.zeros(16 * 1024)}
    ck = make_ck(chunk_bytes=4096)
    ck.prepare(state)
    handle = ck.save(1, state, blocking=False)
    state["w"].fill_(7.0)  # training goes on
    ck.prepare(state)
    assert handle.done()
    target = {"w": torch.ones(16 * 1024)}
    ck.restore(target, step=1)
    assert torch.equal(target["w"], torch.zeros(16 * 1024))
