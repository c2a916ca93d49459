"""One rank fails or differs while the others go on: every rank must decide alike, at once.

Each case left the other ranks waiting in a collective until the group timed out (30
minutes by default; 40 s in these workers), and one garbled rank 0's data. One spawned
2-rank group runs the scenarios of ``support.rank_failure_workers`` in turn (starting
ranks costs seconds): a scenario that left the group out of step would fail the ones after.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ckptflow import open_store
from ckptflow.catalog import checkpoints as catalog
from support import dist_workers, rank_failure_workers

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]
SCENARIOS = [
    "adaptive_slow_rank",
    "state_dict_raises_on_one_rank",
    "delta_base_unlisted_on_rank_0",
    "unexpected_errors_on_rank_0",
    "prepare_during_async_save",
    "ranks_ask_for_different_saves",
    "every_rank_fails_to_write",
    "adaptive_after_a_group_of_rank_0_alone",  # last: before the fix, it hung the group
]


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> dist_workers.Session:
    workdir = tmp_path_factory.mktemp("rank_failures")
    return dist_workers.launch(SCENARIOS, workdir, timeout=150, registry=rank_failure_workers.__name__)


def test_a_slower_rank_saves_at_the_same_steps_as_the_others(session):
    # before: each rank set its interval from its own step time, rank 0 skipped a step rank 1
    # saved, and rank 1 waited in the save's first collective until the group timed out
    fast, slow = session.results("adaptive_slow_rank")
    assert fast["saved"] == slow["saved"]
    store = open_store(str(session.workdir / "adaptive_slow_rank" / "store"))
    committed = [m.step for m in catalog.committed(store, "ranks")]
    assert committed == fast["saved"]
    assert len(committed) > 2  # the interval was set from measurements, not only the initial one


def test_a_state_dict_that_raises_on_one_rank_refuses_the_save_on_every_rank_at_once(session):
    # before: rank 1 raised alone and rank 0 waited in the save's first collective for the
    # group's timeout, then failed with gloo's "Connection closed by peer"
    other, failing = session.results("state_dict_raises_on_one_rank")
    assert failing["error"] == "RuntimeError: no state on rank 1"  # its own error, as raised
    assert other["error"].startswith("CkptflowError: rank 1 could not take the state to save (RuntimeError: no state")
    assert "no rank saved anything" in other["error"]
    assert other["refused_s"] < 10 and failing["refused_s"] < 10
    assert other["steps"] == failing["steps"] == [1]  # the collectives stayed in step: the next save commits


def test_a_listing_that_fails_on_rank_0_costs_the_deltas_not_the_save(session):
    # before: rank 0 raised alone and rank 1 waited in the broadcast of the base until the
    # group timed out, then failed with gloo's "Connection closed by peer"
    for result in session.results("delta_base_unlisted_on_rank_0"):
        assert result["kinds"] == [[1, "full"], [2, "incremental"]]
        assert result["took_s"] < 10


def test_a_bug_where_rank_0_alone_decides_fails_every_rank_at_once(session):
    # before: rank 0 raised its TypeError alone (only ckptflow's errors were shared) and rank 1
    # waited in the broadcast of rank 0's answer until the group timed out
    first, second = session.results("unexpected_errors_on_rank_0")
    assert set(first["errors"]) == {"delta_base", "claim_step", "restore"}
    for name, error in first["errors"].items():
        assert error == "TypeError: a bug on rank 0"  # rank 0's own, as raised
        assert second["errors"][name].startswith("CkptflowError: rank 0 could not ")
        assert (
            "(TypeError: a bug on rank 0; its traceback is in rank 0's log), so no rank went on"
            in (second["errors"][name])
        )
        assert first["took_s"][name] < 10 and second["took_s"][name] < 10
    assert first["steps"] == second["steps"] == [1, 2]  # the collectives stayed in step: the next save commits


def test_ranks_that_ask_for_different_saves_are_refused_on_every_rank_before_anything_is_written(session):
    # before: rank 0 alone decided, so step 5 was committed with rank 1's record written under
    # step 6 (restore found the committed checkpoint damaged: "rank record ... is missing"), and
    # a "full" save was committed for which rank 1 had reused its chunks as an incremental one
    first, second = session.results("ranks_ask_for_different_saves")
    assert first["committed"] == second["committed"] == []
    assert first["errors"]["step"] is not None and second["errors"]["step"] is not None
    for result in (first, second):
        for name, asked in [("step", "rank 0: step 5 (full), rank 1: step 6 (full)"),
                            ("kind", "rank 0: step 8 (full), rank 1: step 8 (incremental)")]:  # fmt: skip
            assert result["errors"][name].startswith("CkptflowError: the ranks asked for different saves of run")
            assert asked in result["errors"][name] and "nothing was written" in result["errors"][name]
            assert result["took_s"][name] < 10
        assert result["steps"] == [[4, "full"], [8, "incremental"]]  # the group stayed in step
        assert result["restored"]


def test_a_save_that_fails_on_every_rank_raises_ckptflows_error_not_dcps(session):
    # before: with more than one rank failing (a store down is down for all), save and
    # handle.wait() raised DCP's CheckpointException, a BaseException: neither
    # ``except StoreUnavailableError`` nor ``except Exception`` caught it, and the loop died
    for result in session.results("every_rank_fails_to_write"):
        for name in ("blocking", "async"):
            kind, message, notes = result["errors"][name]
            assert kind == "StoreUnavailableError"
            assert message == "rank 0: the store is down (after 10 attempts)"
            assert "rank 1: the store is down" in notes
        kind, message, notes = result["errors"]["mixed"]
        assert (kind, message) == ("StoreUnavailableError", "rank 0: the store is down (after 10 attempts)")
        assert "rank 1: no space left on the device" in notes  # every rank's cause is told
        for name in ("rank 1 alone", "rank 1 alone, async"):
            kind, message, _notes = result["errors"][name]
            assert (kind, message) == ("StoreUnavailableError", "rank 1: the store is down (after 10 attempts)")
        # the coordinator holds its lease from planning to commit; DCP never calls its finish when
        # another rank failed, so the Checkpointer gives it back: a lease left live would stall every GC
        assert set(result["leases_left"].values()) == {0}, result["leases_left"]
        assert result["steps"] == [1]  # nothing was committed, and the group stayed in step


def test_ckptflows_groups_time_out_with_the_jobs_own(tmp_path):
    # before: ckptflow's gloo group had torch's default timeout (30 minutes), whatever the job
    # gave init_process_group, so rank 0 waited for rank 1 until rank 1 gave up after 60 s
    session = dist_workers.launch(
        ["save_waits_as_long_as_the_job"], tmp_path, timeout=120, registry=rank_failure_workers.__name__
    )
    waiting, other = session.results("save_waits_as_long_as_the_job")
    assert waiting["error"] is not None and waiting["took_s"] < 15
    assert waiting["given_s"] == other["given_s"] == 40.0 and waiting["unset"] is other["unset"] is None


def test_prepare_waits_for_the_async_save_before_its_own_collective(session):
    # before: prepare gathered on the save group while the async save's collectives ran on it
    # in the background; they paired up differently on the two ranks: rank 0 raised
    # "UnpicklingError: pickle data was truncated" and rank 1 hung until the group timed out
    assert [r["steps"] for r in session.results("prepare_during_async_save")] == [[1], [1]]


def test_an_adaptive_checkpointer_after_a_group_not_every_rank_is_in(session):
    # before: its agreeing group was made with a local synchronization, named on each rank by
    # how many groups that rank held; rank 1 is not in new_group([0]), so the ranks met under
    # different names and every rank hung in Checkpointer() (past the group's timeout)
    for result in session.results("adaptive_after_a_group_of_rank_0_alone"):
        assert result["saved"] == [1, 2]
        assert result["took_s"] < 20
