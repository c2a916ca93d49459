"""Two ranks restoring while they see different things: an outage on one and damage on the
other, a specific step damaged where only one rank reads it, another sharding than the save's,
a fully_shard model with its optimizer and scheduler resumed exactly. One spawned 2-rank group
runs the scenarios of ``support.restore_rank_workers`` in turn."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from ckptflow import Checkpointer
from support import dist_workers, restore_rank_workers

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]
SCENARIOS = [
    "outage_on_one_rank_damage_on_the_other",
    "specific_damaged_step",
    "resharded",
    "fsdp_to_one",
    "step_committed_again_between_the_ranks_reads",
    "state_mismatch_on_one_rank",
]


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> dist_workers.Session:
    workdir = tmp_path_factory.mktemp("restore_ranks")
    return dist_workers.launch(SCENARIOS, workdir, timeout=150, registry=restore_rank_workers.__name__)


def test_an_outage_on_one_rank_outweighs_damage_on_the_other(session):
    for r in session.results("outage_on_one_rank_damage_on_the_other"):
        assert r["error"] == "StoreUnavailableError", r  # never a fallback to step 1
        assert "Input/output error" in r["message"] and r["untouched"]


def test_a_damaged_step_asked_for_is_an_error_on_every_rank_not_another_step(session):
    for r in session.results("specific_damaged_step"):
        assert r["error"] == "NoValidCheckpointError" and r["step"] is None, r
        assert "checkpoint step 2" in r["message"] and "does not match" in r["message"] and r["untouched"]


def test_ranks_that_read_different_commits_of_a_step_read_again_and_load_one(session):
    """Rank 0 read step 2's commit A, rank 1 the commit B that replaced it: each loaded its
    shards of its own commit (rank 0 epoch 2, rank 1 epoch 20), whole and verified, and said
    nothing. The ranks compare the digests, read again, and all load B."""
    results = session.results("step_committed_again_between_the_ranks_reads")
    for r in results:
        once = r["once"]
        assert once["error"] is None and once["digest"] == r["b_digest"], r
        assert once["epoch"] == 20 and once["w_is_b"], r
    assert [r["once"]["earlier_reads"] for r in results] == [1, 0]  # rank 0 did read A first


def test_ranks_that_keep_reading_different_commits_refuse_alike_and_load_nothing(session):
    for r in session.results("step_committed_again_between_the_ranks_reads"):
        always = r["always"]
        assert always["error"] == "StoreUnavailableError" and always["untouched"], r
        assert "its ranks read different commits of it 3 times in a row" in always["message"], r


def test_a_state_that_does_not_fit_on_one_rank_is_named_by_rank_and_key_on_every_rank(session):
    """Only rank 1's state has ``extra``: rank 0 raised "the state does not match" of a state
    that fits it, naming no rank. Every rank names rank 1 and its first mismatched key now."""
    for r in session.results("state_mismatch_on_one_rank"):
        assert r["error"] == "StateMismatchError" and r["untouched"], r
        assert "rank 1 of 2: the state does not match" in r["message"], r
        assert "first mismatched key 'extra'" in r["message"] and "rank 0" not in r["message"], r


def test_rows_saved_restore_into_columns_and_replicas(session):
    for r in session.results("resharded"):
        assert r["cols_step"] == 1 and r["cols_w"] and r["cols_v"] and r["rep_w"] and r["rep_v"], r


def test_a_two_rank_fully_sharded_run_resumes_exactly_on_two_ranks_and_in_one_process(session):
    first, second = session.results("fsdp_to_one")
    assert first["same_after_resume"] and second["same_after_resume"]
    model = restore_rank_workers._model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    root = session.workdir / "fsdp_to_one" / "store"
    with Checkpointer(str(root), run=dist_workers.RUN, restore_rng=False) as ck:  # not rank 0's RNG here
        assert ck.restore({"model": model, "optim": opt, "sched": sched}, step=3).step == 3
    restore_rank_workers._train(model, opt, sched, 3, 3)
    got = {k: v.tolist() for k, v in model.state_dict().items()}
    assert got == json.loads(json.dumps(first["full"]))  # the uninterrupted 2-rank run, bit for bit


def test_in_one_process_too_an_outage_outweighs_damage_elsewhere(tmp_path):
    """The same store state as across two ranks, read by one process: it fell back to step 1
    (damage anywhere outweighed the failed read), where two ranks stop. Now one rule: stop."""
    from ckptflow.errors import StoreUnavailableError
    from ckptflow.format import layout as fmt
    from support.corrupt import corrupt_chunk, only_in

    root = tmp_path / "store"
    with Checkpointer(str(root), "r", chunk_bytes=1 << 12) as ck:
        for step in (1, 2):
            ck.save(step, {"a": torch.full((4096,), float(step)), "b": torch.full((4096,), -float(step))})
    damaged, unread, *_ = only_in(root, "r", 2, 1)
    corrupt_chunk(root, "r", 2, damaged)
    reader = Checkpointer(str(root), "r")
    restore_rank_workers.fail_reads(reader.store, fmt.chunk_key(unread))
    state = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    with pytest.raises(StoreUnavailableError):
        reader.restore(state)
    reader.close()
    assert not state["a"].any() and not state["b"].any()  # nothing loaded, step 1 neither
