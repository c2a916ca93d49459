"""The garbage collector is paused for a blocking save's and a restore's own span only, and
left as the process had it."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.training.collector import collector_paused


@pytest.fixture
def collections():
    """Every collection that starts while the test runs, by generation."""
    started: list[int] = []

    def note(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(note)
    yield started
    gc.callbacks.remove(note)


def _state() -> dict:
    return {"model": {f"layer{i}.bias": torch.full((8,), float(i)) for i in range(1500)}}


def test_a_blocking_save_and_a_restore_of_many_tensors_collect_once_when_done(tmp_path, collections):
    """Once: what the operation left young is looked at as the collector resumes."""
    assert gc.isenabled()
    saved, live = _state(), _state()
    for tensor in live["model"].values():
        tensor.zero_()
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        gc.collect()  # counts from zero: a collection due just before the save is not the save's
        del collections[:]
        ck.save(1, saved)
        assert collections in ([], [0]) and gc.isenabled()
        gc.collect()
        del collections[:]
        ck.restore(live)
        assert collections in ([], [0]) and gc.isenabled()
        assert torch.equal(live["model"]["layer1499.bias"], torch.full((8,), 1499.0))
        handle = ck.save(2, saved, blocking=False)  # training goes on meanwhile: not paused
        handle.wait()
    garbage = [[] for _ in range(2000)]
    for cycle in garbage:
        cycle.append(cycle)
    del garbage
    assert collections  # and the collector runs again afterwards


def test_overlapping_pauses_resume_the_collector_when_the_last_one_ends():
    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def other():
        with collector_paused():
            entered.set()
            release.wait()

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other operation still runs
    release.set()
    thread.join()
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off_and_a_failure_resumes_it():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("the operation failed")
    assert gc.isenabled()
