"""Checkpointer, save side: round trips, listing, async saves, incremental saves, dedup
across runs, save policies, saving to an already committed step, and stored metadata.

Restore-side behaviour (RNG, explicit step vs fallback, mismatched or unsupported state)
is in training/test_restore.py; shared helpers are in tests/support/ and conftest.py (``make_ck``).
"""

from __future__ import annotations

import copy
import json
import os
import time

import numpy as np
import pytest
import torch

from ckptflow import CheckpointExistsError, SavePolicy, gc
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from support.corrupt import manifest_path, tree_bytes
from support.states import assert_state_equals, snapshot

# ---- helpers ----------------------------------------------------------------------------


def chunk_files(root: str) -> dict[str, int]:
    """relative path -> size of every chunk file on disk."""
    out = {}
    base = os.path.join(root, "chunks")
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def read_stats(root: str, run: str, step: int) -> dict:
    return dict(catalog.read_manifest(open_store(root), run, step).stats.__dict__)


class BigBias(torch.nn.Module):
    """A 64x64 float32 weight (16 KiB) and a 64-element bias (256 B)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(64, 64, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(64, generator=g))


# ---- round trip -------------------------------------------------------------------------


def test_round_trip_model_optimizer_scheduler_and_json(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory(seed=0)
    tiny_train_step(state, 3)
    state["extra"] = {"epoch": 3, "seen": [1, 2, 3], "name": "x"}
    snap = snapshot(state)
    saved_lr = state["optim"].param_groups[0]["lr"]
    assert saved_lr != 1e-2  # the scheduler has decayed it: restoring it means something

    ck = make_ck()
    res = ck.save(3, state, metadata={"loss": 0.5, "config": {"lr": 1e-2}})
    assert res.step == 3 and res.kind == "full"
    assert res.info is not None and res.info.step == 3 and res.info.chunks > 0
    assert res.info.metadata == {"loss": 0.5, "config": {"lr": 1e-2}}

    # keep training: everything moves away from the snapshot
    tiny_train_step(state, 3)
    state["extra"] = "changed"
    assert not torch.equal(state["model"].state_dict()["0.weight"], snap["model"]["0.weight"])
    assert state["optim"].param_groups[0]["lr"] != saved_lr
    assert state["sched"].state_dict() != snap["sched"]

    result = ck.restore(state)
    assert result.step == 3
    assert result.skipped == []
    assert result.metadata == {"loss": 0.5, "config": {"lr": 1e-2}}
    assert_state_equals(state, snap)
    assert state["optim"].param_groups[0]["lr"] == saved_lr
    ck.close()

    # a fresh process (new objects, other init, no optimizer state yet) restores the same
    fresh = tiny_state_factory(seed=123)
    ck2 = make_ck()
    assert ck2.restore(fresh).step == 3
    assert_state_equals(fresh, snap)
    # and training continues identically from both
    torch.manual_seed(7)
    tiny_train_step(state, 1)
    torch.manual_seed(7)
    tiny_train_step(fresh, 1)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[k], v)


def test_round_trip_json_value_types(make_ck, tiny_state_factory):
    state = tiny_state_factory()
    value = {
        "tuple": (1, "a", None),
        "bytes": b"\x00\xffbinary",
        "int_keys": {1: "one", 2: "two"},
        "float": 1.5,
        "bool": True,
        "np": np.int64(4),
        "nested": [{"a": [1, 2]}, []],
    }
    state["extra"] = copy.deepcopy(value)
    ck = make_ck()
    ck.save(1, state)
    state["extra"] = None
    ck.restore(state)
    expected = dict(value, np=4)
    assert state["extra"] == expected
    assert isinstance(state["extra"]["tuple"], tuple)
    assert isinstance(state["extra"]["bytes"], bytes)


def test_list_reports_committed_checkpoints(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory()
    ck = make_ck()
    assert ck.list() == []
    for step in (5, 10, 15):
        tiny_train_step(state)
        ck.save(step, state, metadata={"step": step})
    infos = ck.list()
    assert [i.step for i in infos] == [5, 10, 15]
    assert [i.metadata for i in infos] == [{"step": 5}, {"step": 10}, {"step": 15}]
    assert all(i.run == "r" and i.digest for i in infos)
    assert infos[0].base_step is None and infos[1].base_step == 5 and infos[2].base_step == 10


# ---- async save ---------------------------------------------------------------------------


def test_async_save_restores_exactly_and_caller_may_keep_training(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory()
    tiny_train_step(state, 2)
    snap = snapshot(state)
    ck = make_ck()

    called = time.perf_counter()
    losses = [0.9]
    handle = ck.save(2, state, blocking=False, metadata={"async": True, "losses": losses})
    returned_after = time.perf_counter() - called
    losses.append(float("nan"))  # the loop's own list: the save holds the metadata as it was
    assert handle.step == 2 and handle.kind == "full"
    assert 0 < handle.blocked_s <= returned_after  # the time save() held the caller, measured inside the call
    # right after save returns, training mutates weights and optimizer state in place
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1000.0)
    tiny_train_step(state, 2)
    for pstate in state["optim"].state.values():
        pstate["exp_avg"].fill_(-7.0)

    result = handle.wait()
    assert handle.done()
    assert result.step == 2 and result.kind == "full"
    assert result.info is not None and result.info.metadata == {"async": True, "losses": [0.9]}
    assert ck.verify(2).ok

    # the checkpoint holds the values at save time, not the mutated ones
    fresh = tiny_state_factory(seed=5)
    restored = make_ck().restore(fresh)
    assert restored.step == 2 and restored.metadata == {"async": True, "losses": [0.9]}
    assert_state_equals(fresh, snap)


def test_async_save_then_next_save_and_restore_wait_for_it(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory()
    ck = make_ck()
    tiny_train_step(state)
    snap1 = snapshot(state)
    ck.save(1, state, blocking=False)
    tiny_train_step(state)
    snap2 = snapshot(state)
    h2 = ck.save(2, state, blocking=False)  # waits for step 1 to commit first
    assert 1 in [i.step for i in ck.list()]  # save() waited for step 1 to commit
    tiny_train_step(state)
    result = ck.restore(state)  # waits for step 2
    assert h2.done()
    assert result.step == 2
    assert_state_equals(state, snap2)
    assert ck.restore(state, step=1).step == 1
    assert_state_equals(state, snap1)
    assert ck.wait() is None  # nothing pending any more


# ---- incremental --------------------------------------------------------------------------


def test_incremental_writes_only_changed_chunks(make_ck, ckpt_store_dir):
    model = BigBias()
    state = {"model": model}
    ck = make_ck(chunk_bytes=1024)  # the 16 KiB weight spans 16 chunks

    full = ck.save(1, state).info
    n_chunks = len(chunk_files(ckpt_store_dir))
    assert n_chunks == 17  # 16 weight chunks + 1 bias chunk
    assert full.kind == "full" and full.chunks == 17
    assert full.bytes_written == 64 * 64 * 4 + 64 * 4

    # change ONE small tensor: the bias
    with torch.no_grad():
        model.bias.add_(1.0)
    inc = ck.save(2, state, kind="incremental").info
    assert inc.kind == "incremental" and inc.base_step == 1
    assert inc.bytes_written == 64 * 4
    assert read_stats(ckpt_store_dir, "r", 2)["chunks_written"] == 1
    assert inc.chunks == 17  # still a complete checkpoint
    assert len(chunk_files(ckpt_store_dir)) == n_chunks + 1

    # change one element of the big weight: exactly one 1 KiB chunk is new
    with torch.no_grad():
        model.weight[3, 5] += 1.0  # byte offset (3*64+5)*4 = 788 -> the first chunk
    inc3 = ck.save(3, state, kind="incremental").info
    assert inc3.bytes_written == 1024
    assert read_stats(ckpt_store_dir, "r", 3)["chunks_written"] == 1
    assert len(chunk_files(ckpt_store_dir)) == n_chunks + 2

    # nothing changed: an incremental save writes nothing at all
    inc4 = ck.save(4, state, kind="incremental").info
    assert inc4.bytes_written == 0
    assert read_stats(ckpt_store_dir, "r", 4)["chunks_written"] == 0
    assert len(chunk_files(ckpt_store_dir)) == n_chunks + 2
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # the incremental checkpoint stands on its own: drop every older manifest, collect garbage
    for step in (1, 2):
        os.remove(manifest_path(ckpt_store_dir, "r", step))
    report = gc(ckpt_store_dir, grace=0, now=1e12)  # everything unreferenced is "old"
    assert report.deleted  # step 1's old bias chunk and the old first weight chunk go
    assert ck.verify(3).ok and ck.verify(4).ok

    fresh = BigBias(seed=9)
    result = make_ck(chunk_bytes=1024).restore({"model": fresh}, step=3)
    assert result.step == 3
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_first_save_of_a_run_is_always_full(make_ck):
    ck = make_ck()
    res = ck.save(7, {"model": BigBias()}, kind="incremental")
    assert res.kind == "full" and res.info.kind == "full" and res.info.base_step is None


def test_invalid_kind_is_rejected(make_ck, ckpt_store_dir):
    with pytest.raises(ValueError, match="kind"):
        make_ck().save(1, {"model": BigBias()}, kind="delta")
    assert chunk_files(ckpt_store_dir) == {}


# ---- dedup across runs --------------------------------------------------------------------


def test_dedup_across_runs_on_one_store(make_ck, ckpt_store_dir):
    model = BigBias()
    a = make_ck(run="run-a", chunk_bytes=1024)
    a.save(1, {"model": model})
    before = chunk_files(ckpt_store_dir)
    assert len(before) == 17

    b = make_ck(run="run-b", chunk_bytes=1024)
    res_b = b.save(1, {"model": model})
    after = chunk_files(ckpt_store_dir)
    assert after == before  # no new chunk file, no byte more on disk
    assert res_b.info.chunks == 17
    # run b's next (incremental) save of the same weights writes nothing new at all
    res_b2 = b.save(2, {"model": model}, kind="incremental")
    assert res_b2.info.bytes_written == 0
    assert chunk_files(ckpt_store_dir) == before

    # both runs are independent and complete
    assert [i.step for i in a.list()] == [1]
    assert [i.step for i in b.list()] == [1, 2]
    for ck, step in ((a, 1), (b, 1), (b, 2)):
        fresh = BigBias(seed=3)
        assert ck.restore({"model": fresh}, step=step).step == step
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


# ---- policy -------------------------------------------------------------------------------


def test_save_policy_kind_for():
    p = SavePolicy(full_every=10, incremental_every=2)
    assert p.kind_for(0) == "full"
    assert p.kind_for(10) == "full"
    assert p.kind_for(20) == "full"
    assert p.kind_for(2) == "incremental"
    assert p.kind_for(14) == "incremental"
    assert p.kind_for(3) is None
    assert p.kind_for(11) is None

    only_full = SavePolicy(full_every=5)
    assert [only_full.kind_for(s) for s in range(11)] == [
        "full",
        None,
        None,
        None,
        None,
        "full",
        None,
        None,
        None,
        None,
        "full",
    ]
    # full wins where both divide
    assert SavePolicy(full_every=4, incremental_every=2).kind_for(8) == "full"

    for bad in (dict(full_every=0), dict(full_every=-1), dict(full_every=5, incremental_every=0)):
        with pytest.raises(ValueError):
            SavePolicy(**bad)


def test_save_with_policy(make_ck, ckpt_store_dir, tiny_state_factory):
    state = tiny_state_factory()
    ck = make_ck(policy=SavePolicy(full_every=10, incremental_every=5))

    assert ck.save(3, state) is None  # policy: not a save step
    assert not os.path.exists(os.path.join(ckpt_store_dir, "runs"))
    assert chunk_files(ckpt_store_dir) == {}
    assert ck.list() == []
    assert ck.save(3, state, blocking=False) is None

    assert ck.save(10, state).kind == "full"
    assert ck.save(15, state).kind == "incremental"
    assert ck.save(17, state) is None
    assert [i.step for i in ck.list()] == [10, 15]
    # an explicit kind overrides the policy
    assert ck.save(18, state, kind="full").kind == "full"
    assert [(i.step, i.kind) for i in ck.list()] == [(10, "full"), (15, "incremental"), (18, "full")]


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("blocking", [True, False])
def test_save_to_committed_step_raises_and_changes_nothing(
    make_ck, ckpt_store_dir, tiny_state_factory, tiny_train_step, blocking
):
    state = tiny_state_factory()
    tiny_train_step(state, 1)
    ck = make_ck()
    ck.save(4, state, metadata={"v": 1})
    snap = snapshot(state)
    before = tree_bytes(ckpt_store_dir)

    tiny_train_step(state, 2)
    with pytest.raises(CheckpointExistsError, match="already committed"):
        ck.save(4, state, metadata={"v": 2}, blocking=blocking)
    assert tree_bytes(ckpt_store_dir) == before

    # also from another Checkpointer (a restarted job)
    with pytest.raises(CheckpointExistsError):
        make_ck().save(4, state, kind="full")
    assert tree_bytes(ckpt_store_dir) == before

    result = ck.restore(state)
    assert result.step == 4 and result.metadata == {"v": 1}
    assert_state_equals(state, snap)


def test_metadata_is_stored_as_json(make_ck, ckpt_store_dir, tiny_state_factory):
    ck = make_ck()
    ck.save(1, tiny_state_factory(), metadata={"metrics": {"loss": 1.25}, "tags": ["a"]})
    with open(manifest_path(ckpt_store_dir, "r", 1), "rb") as f:
        raw = json.loads(f.read())
    assert raw["metadata"] == {"metrics": {"loss": 1.25}, "tags": ["a"]}
    assert raw["kind"] == "full" and raw["step"] == 1 and raw["run"] == "r"
