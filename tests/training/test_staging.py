"""``Checkpointer.prepare``: host staging buffers allocated before the first async save,
so that save holds the loop only for the copy (measured by benchmarks/save_restore.py,
not here). What is tested: preparing writes nothing, refuses what a save would refuse,
and a prepared async save (and the next, training in between) restores exactly."""

from __future__ import annotations

import pytest

from ckptflow import UnsupportedStateError
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
