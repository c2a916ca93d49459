"""Two-rank (gloo, CPU) saves and restores of DTensor-sharded state, across world sizes.

One module-scoped session spawns 2 ranks that run every scenario of tests/support/dist_workers.py
in turn; each test checks its scenario's results, and fails with the children's tracebacks
if that scenario did not complete on every rank.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ckptflow import Checkpointer
from ckptflow.format import layout as fmt
from support import dist_workers as W

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


@pytest.fixture
def keep_rng():
    """Single-process restores below must not leave another rank's RNG in this process."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


ONE_PROCESS_STEP = 4


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> W.Session:
    """One spawned 2-rank group runs every scenario in turn (starting ranks costs ~6 s).

    The 1-process checkpoint that ``load_sharded`` reads is written here first.
    """
    workdir = tmp_path_factory.mktemp("dist")
    (workdir / "load_sharded").mkdir()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    with Checkpointer(str(workdir / "load_sharded" / "store"), run=W.RUN, chunk_bytes=W.CHUNK, threads=2) as ck:
        s = ONE_PROCESS_STEP
        ck.save(s, {"w": W.full_weight(s), "rep": W.replicated(s), "epoch": s})
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    torch.set_rng_state(rng[2])
    return W.launch(
        ["save_sharded", "load_sharded", "restore_agreement", "per_rank_values", "save_sharded_auto"], workdir
    )


def test_two_rank_dtensor_save_loads_into_one_process(session, keep_rng):
    results = session.results("save_sharded")
    root = session.workdir / "save_sharded" / "store"
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["coordinator_info"] == (rank == 0)
        assert r["step"] == 1 and r["skipped"] == []
        assert r["local_rows"] == [W.shard_rows(rank, 2)[1] - W.shard_rows(rank, 2)[0], W.COLS]
        assert r["w_local_ok"] and r["w_full_ok"] and r["rep_ok"] and r["epoch"] == 1

    for rank, r in enumerate(results):  # the async save (step 2) snapshotted before returning
        assert r["async_step"] == 2 and r["async_info"] == (rank == 0)
        assert r["async"]["w_local_ok"] and r["async"]["rep_ok"] and r["async"]["epoch"] == 2, r["async"]

    # What the coordinator committed: two ranks, two rank records, each naming its rank.
    manifest = json.loads((root / fmt.manifest_key(W.RUN, 1)).read_bytes())
    assert manifest["world_size"] == 2
    assert sorted(c["offsets"][0] for c in manifest["dcp"]["tensors"]["w"]["chunks"]) == [0, 5]
    for rank in range(2):
        record = json.loads((root / fmt.rank_key(W.RUN, 1, rank, manifest["save_id"])).read_bytes())
        assert record["rank"] == rank and record["world_size"] == 2

    # One process, no process group, plain full tensors.
    state = {"w": torch.zeros(W.ROWS, W.COLS), "rep": torch.zeros(13, dtype=torch.float64), "epoch": None}
    ck = Checkpointer(str(root), run=W.RUN)
    result = ck.restore(state, step=1)
    assert result.step == 1 and result.skipped == []
    assert torch.equal(state["w"], W.full_weight(1))
    assert torch.equal(state["rep"], W.replicated(1))
    assert state["epoch"] == 1
    assert ck.verify(1).ok
    # The single process takes rank 0's record, RNG included.
    assert result.rng_restored
    W.seed_rank(0)
    expected_rank0 = W.draws()
    ck.restore(state, step=1)
    assert W.draws() == expected_rank0
    state = {"w": torch.zeros(W.ROWS, W.COLS), "rep": torch.zeros(13, dtype=torch.float64), "epoch": None}
    assert ck.restore(state).step == 2 and torch.equal(state["w"], W.full_weight(2)) and state["epoch"] == 2
    ck.close()


def test_each_rank_restores_its_own_rng(session):
    results = session.results("save_sharded")
    for r in results:
        assert r["rng_restored"], r
        assert r["draws_after_restore"] == r["expected_draws"], f"rank {r['rank']} got another RNG state"
        assert r["consumed"][:3] != r["expected_draws"]  # the RNG really had moved on
    # Ranks were seeded differently, so a rank restoring rank 0's state would be caught.
    assert results[0]["expected_draws"] != results[1]["expected_draws"]
    for rank, r in enumerate(results):
        W.seed_rank(rank)
        assert r["expected_draws"] == W.draws()


def test_one_process_save_loads_into_two_rank_dtensor_state(session):
    results = session.results("load_sharded")
    for rank, r in enumerate(results):
        assert r["step"] == ONE_PROCESS_STEP and r["skipped"] == []
        lo, hi = W.shard_rows(rank, 2)
        assert r["local_rows"] == [hi - lo, W.COLS]
        assert r["w_local_ok"], f"rank {rank}'s shard is not rows {lo}:{hi} of the saved tensor"
        assert r["w_full_ok"] and r["rep_ok"] and r["epoch"] == ONE_PROCESS_STEP
    # Only rank 0 has a saved RNG state of its own (the save had one rank).
    assert [r["rng_restored"] for r in results] == [True, False]


def test_ranks_agree_to_fall_back_when_only_one_rank_hits_corruption(session):
    results = session.results("restore_agreement")
    digest = results[0]["corrupted"]
    assert digest and results[1]["corrupted"] == digest
    for rank, r in enumerate(results):
        assert r["step"] == 1, f"rank {rank} restored step {r['step']} (skipped {r['skipped']})"
        assert [s for s, _ in r["skipped"]] == [3, 2]
        assert digest[:16] in r["skipped"][0][1], r["skipped"]  # the reason names the bad chunk
        assert "ranks/1." in r["skipped"][1][1], r["skipped"]  # ... and the bad rank record
        assert r["w_local_ok"] and r["w_full_ok"] and r["rep_ok"] and r["epoch"] == 1
        assert r["verify"] == {"1": True, "2": False, "3": False}
    assert results[0]["skipped"] == results[1]["skipped"]


def test_per_rank_values_come_back_to_their_own_rank_and_plain_ones_do_not(session):
    results = sorted(session.results("per_rank_values"), key=lambda r: r["rank"])
    assert [r["per_rank"] for r in results] == [[1.0] * 3, [2.0] * 3]
    # a plain tensor is deduplicated by DCP: every rank gets the one copy DCP kept (documented)
    assert results[0]["plain"] == results[1]["plain"] in ([1.0] * 3, [2.0] * 3)


def test_two_ranks_store_their_changes_as_deltas_on_their_own_shards(session, keep_rng):
    results = session.results("save_sharded_auto")
    for r in results:
        assert r["step"] == 2 and r["w_full_ok"]
    assert results[0]["bases"] == 8  # every chunk of both shards moved a little: a delta each
    root = str(session.workdir / "save_sharded_auto" / "store")
    with Checkpointer(root, run=W.RUN) as ck:
        target = {"w": torch.zeros(W.DRIFT_ROWS, 64)}
        assert ck.restore(target).step == 2
    assert torch.equal(target["w"], W.drifting_weight(2))
