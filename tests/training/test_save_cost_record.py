"""Every commit records what its save cost (``ckptflow.format.save_cost``), read back from the store."""

import json
import time

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.save_cost import SaveCost
from support.states import RUN, tiny_state, tiny_train

PAUSE_S = 0.05  # per step of "training" between saves: what the step time must measure


def _steps(state: dict, n: int) -> float:
    """``n`` steps of "training"; the seconds each took, as the loop measured them."""
    start = time.perf_counter()
    for _ in range(n):
        tiny_train(state)
        time.sleep(PAUSE_S)
    return (time.perf_counter() - start) / n


def test_blocking_and_async_saves_record_blocked_time_duration_bytes_and_step_time(tmp_path):
    root, state = str(tmp_path), tiny_state()
    with Checkpointer(root, RUN) as ckpt:
        ckpt.save(0, state)
        looped_4 = _steps(state, 4)
        ckpt.save(4, state, kind="incremental")
        looped_2 = _steps(state, 2)
        ckpt.save(6, state, blocking=False).wait()
    store = open_store(root)
    first, inc, async_full = (catalog.read_manifest(store, RUN, s) for s in (0, 4, 6))
    assert first.save_cost is not None and first.save_cost.step_time_s is None  # nothing to measure from yet
    assert first.save_cost.blocked_s == first.save_cost.duration_s > 0  # a blocking save holds the loop throughout
    assert inc.save_cost is not None and inc.save_cost.steps_since == 4
    # the loop's own time per step, not the saves' (on a loaded machine a step is slower than PAUSE_S)
    assert PAUSE_S <= inc.save_cost.step_time_s < looped_4 + 0.01
    assert async_full.save_cost is not None and async_full.save_cost.steps_since == 2
    assert PAUSE_S <= async_full.save_cost.step_time_s < looped_2 + 0.01
    assert 0 < async_full.save_cost.blocked_s <= async_full.save_cost.duration_s
    # bytes per kind: the full wrote every chunk, the incremental only what changed
    assert (first.kind, inc.kind, async_full.kind) == ("full", "incremental", "full")
    assert async_full.stats.bytes_written == async_full.stats.unique_bytes
    assert 0 < inc.stats.bytes_written <= inc.stats.logical_bytes
    doc = json.loads(store.get(fmt.manifest_key(RUN, 4)))
    assert doc["save_cost"]["steps_since"] == 4  # plain JSON in the manifest


def test_step_time_after_a_restore_is_measured_from_the_restore(tmp_path):
    root, state = str(tmp_path), tiny_state()
    with Checkpointer(root, RUN) as ckpt:
        ckpt.save(10, state)
    with Checkpointer(root, RUN) as resumed:
        resumed.restore(state)
        _steps(state, 3)
        resumed.save(13, state)
    cost = catalog.read_manifest(open_store(root), RUN, 13).save_cost
    assert cost is not None and cost.steps_since == 3 and cost.step_time_s >= PAUSE_S


def test_a_malformed_or_absent_record_reads_as_none_and_the_checkpoint_still_parses(tmp_path):
    root, state = str(tmp_path), tiny_state()
    with Checkpointer(root, RUN) as ckpt:
        ckpt.save(1, state)
    store = open_store(root)
    manifest = catalog.read_manifest(store, RUN, 1)
    for bad in ({"blocked_s": -1, "duration_s": 1}, {"blocked_s": "x"}, [1, 2], None):
        doc = {**manifest.to_json(), "save_cost": bad}
        assert Manifest.from_json(doc, "test").save_cost is None
    assert SaveCost.from_json({"blocked_s": 1, "duration_s": 2, "step_time_s": None, "steps_since": None}) == SaveCost(
        blocked_s=1.0, duration_s=2.0
    )


def test_step_time_after_a_failed_save_is_measured_from_that_failure(tmp_path, monkeypatch):
    """A save that failed did not move the point the step time is measured from: the next
    save counted the failed save's seconds as training (a 0.5 s failure over 2 steps: 0.25 s
    a step where the loop took 0.05 s), and the interval advice read that."""
    import pytest

    from ckptflow.chunks.io import ChunkStore

    root, state = str(tmp_path), tiny_state()
    real = ChunkStore._store

    def slow_failure(*_args, **_kwargs):
        time.sleep(0.5)
        raise OSError(28, "No space left on device (injected)")

    with Checkpointer(root, RUN) as ckpt:
        ckpt.save(0, state)
        looped = _steps(state, 1)
        monkeypatch.setattr(ChunkStore, "_store", slow_failure)
        with pytest.raises(Exception, match="No space left"):
            ckpt.save(1, state)
        monkeypatch.setattr(ChunkStore, "_store", real)
        looped = max(looped, _steps(state, 1))
        ckpt.save(2, state)
    cost = catalog.read_manifest(open_store(root), RUN, 2).save_cost
    assert cost is not None and cost.steps_since == 1 and PAUSE_S <= cost.step_time_s < looped + 0.1
