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
        handle = ck.save(2, saved, blocking=False)
        assert gc.isenabled()  # training goes on while it writes: not paused
        handle.wait()
    del collections[:]
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


def test_a_rejected_checkpoint_holds_no_decoded_chunk_when_the_next_is_tried(tmp_path, monkeypatch):
    """The collector is paused during a restore, and a rejected try's errors hold its frames in
    reference cycles: what it kept decoded must be let go before the older checkpoint is read."""
    from ckptflow.chunks.streaming import CheckedChunk
    from ckptflow.training.restore import Restore
    from support.corrupt import corrupt_chunk

    root = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(root, "r", codec="zstd", chunk_bytes=64 << 10) as ck:
        for step in (1, 2):
            ck.save(step, {"model": {f"w{i}": torch.randn(32 << 10, generator=gen) for i in range(4)}})
    corrupt_chunk(root, "r", 2)
    alive: list[int] = []
    try_load = Restore._try_load

    def counting(self, cand, *args, **kwargs):
        alive.append(sum(1 for o in gc.get_objects() if type(o) is CheckedChunk and o.data is not None))
        return try_load(self, cand, *args, **kwargs)

    monkeypatch.setattr(Restore, "_try_load", counting)
    with Checkpointer(root, "r") as ck:
        result = ck.restore({"model": {f"w{i}": torch.zeros(32 << 10) for i in range(4)}})
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    assert alive == [0, 0]
