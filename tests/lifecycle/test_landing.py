"""Landing without Dagster: which commit records are new since a cursor, and the cursor after."""

import json
import os

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.lifecycle.landing import FULL_SCAN_S, MAX_WAITING, SLACK, land, new_commits
from ckptflow.store import open_store
from support.corrupt import flip_byte, manifest_path, reseal_manifest
from support.faulty_store import FaultyStore
from support.states import tiny_state

RUN = "r"
T0 = 1_000_000.0


@pytest.fixture
def root(tmp_path):
    """Steps 1, 2, 3 of ``RUN`` committed at T0 + 10, + 20, + 30 (their commit records' times)."""
    root = str(tmp_path / "store")
    state = tiny_state()
    with Checkpointer(root, RUN) as ck:
        for step in (1, 2, 3):
            ck.save(step, state)
    for step in (1, 2, 3):
        committed_at(root, step, T0 + 10 * step)
    return root


def committed_at(root: str, step: int, when: float, run: str = RUN) -> None:
    os.utime(manifest_path(root, run, step), (when, when))


def keys(landed) -> list[str]:
    return [c.key for c in landed]


def name(step: int, run: str = RUN) -> str:
    return fmt.checkpoint_name(run, step)


def test_commits_land_oldest_first_once_each_named_by_their_digest(root):
    store = open_store(root)
    committed_at(root, 1, T0 + 40)  # newer than steps 2 and 3
    landed, cursor = land(store, None)
    assert keys(landed) == [name(2), name(3), name(1)]
    for c in landed:
        digest = catalog.read_manifest(store, RUN, fmt.parse_checkpoint_name(c.key)[1]).digest
        assert (c.digest, c.marker, c.validated) == (digest, digest[:16], False)
    assert land(store, cursor)[0] == []
    assert json.loads(cursor)["t"] == T0 + 40


def test_a_full_listing_lands_commits_whose_times_are_behind_the_watermark(root):
    """A run copied in with its times kept (``cp -a``), and step 2 committed again by a
    writer whose clock is behind: no quick tick sees them, the next full listing lands
    each by its digest, once (the cursor keeps them pending until validated)."""
    store = open_store(root)
    landed, cursor = new_commits(store, {}, limit=10, now=T0)
    for c in landed:
        lifecycle.validate(store, RUN, fmt.parse_checkpoint_name(c.key)[1])
    with Checkpointer(root, "copied") as ck:
        for step in (5, 6):
            ck.save(step, tiny_state(seed=step))
            committed_at(root, step, T0 - 600, run="copied")
    old_digest = catalog.read_manifest(store, RUN, 2).digest
    lifecycle.expire(store, RUN, 2)
    with Checkpointer(root, RUN) as ck:
        ck.save(2, tiny_state(seed=7))
    committed_at(root, 2, T0 - 300)
    assert new_commits(store, cursor, limit=10, now=T0 + 1)[0] == []  # a quick tick
    full, after = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    new_digest = catalog.read_manifest(store, RUN, 2).digest
    assert new_digest != old_digest
    assert [(c.key, c.digest) for c in full] == [
        (name(5, "copied"), catalog.read_manifest(store, "copied", 5).digest),
        (name(6, "copied"), catalog.read_manifest(store, "copied", 6).digest),
        (name(2), new_digest),
    ]
    assert after["t"] == cursor["t"]  # the watermark stays where the fresh commits put it
    assert len(after["pending"]) == 3  # landed, not validated yet: not landed again
    assert new_commits(store, after, limit=10, now=T0 + 2 * FULL_SCAN_S)[0] == []
    for run, step in (("copied", 5), ("copied", 6), (RUN, 2)):
        lifecycle.validate(store, run, step)
    landed, after = new_commits(store, after, limit=10, now=T0 + 3 * FULL_SCAN_S)
    assert landed == [] and after["pending"] == []  # validated: nothing left to remember


def test_a_cursor_of_an_older_layout_starts_over(root):
    store = open_store(root)
    _, cursor = land(store, None)
    assert land(store, cursor)[0] == []
    older = json.dumps({"t": T0 + 10 * SLACK, "seen": {}})  # "seen" was not a list; its watermark is past all

    assert keys(land(store, older)[0]) == [name(1), name(2), name(3)]


@pytest.mark.parametrize(
    "cursor",
    [
        "[]",
        "null",
        "{not json",
        '{"t": "x"}',
        '{"t": NaN}',  # compared false with every time: landed nothing, ever
        '{"full_at": "x"}',
        '{"seen": ["no-at-sign"]}',
        '{"seen": ["r/1@inf"]}',
        '{"frontier": []}',
        '{"frontier": {"r": "x"}}',
    ],
)
def test_a_cursor_of_a_shape_never_written_starts_over_instead_of_failing_every_tick(root, cursor):
    store = open_store(root)
    landed, after = land(store, cursor)
    assert keys(landed) == [name(1), name(2), name(3)]
    assert land(store, after)[0] == []


def test_the_cursor_of_a_tick_that_landed_nothing_is_kept(tmp_path):
    """Before: its watermark, -inf (JSON -Infinity), read as a cursor of a shape never
    written, so every tick started over with a full listing until a commit landed."""
    store = open_store(str(tmp_path / "empty"))
    landed, first = land(store, None)
    assert landed == [] and json.loads(first)["t"] == float("-inf")
    _, second = land(store, first)
    assert json.loads(second)["full_at"] == json.loads(first)["full_at"]  # a quick tick, not a full one


def test_a_validated_commit_lands_marked_so(root):
    store = open_store(root)
    lifecycle.validate(store, RUN, 2)
    landed, _ = land(store, None)
    assert [c.validated for c in landed] == [False, True, False]


def test_paging_moves_the_watermark_only_as_far_as_what_was_taken(root):
    store = open_store(root)
    first, cursor = new_commits(store, {}, limit=2, now=T0)
    assert keys(first) == [name(1), name(2)] and cursor["t"] == T0 + 20
    rest, cursor = new_commits(store, cursor, limit=2, now=T0 + 1)
    assert keys(rest) == [name(3)] and cursor["t"] == T0 + 30


def test_a_commit_within_slack_behind_the_watermark_lands_one_beyond_it_does_not(root):
    """A writer whose clock lags by less than ``SLACK`` is still landed."""
    store = open_store(root)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    state = tiny_state()
    with Checkpointer(root, "lagging") as ck:
        ck.save(1, state)
        ck.save(2, state)
    committed_at(root, 1, T0 + 30 - SLACK / 2, run="lagging")
    committed_at(root, 2, T0 + 30 - SLACK * 2, run="lagging")
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + 1)
    assert keys(landed) == [name(1, "lagging")]
    assert new_commits(store, cursor, limit=10, now=T0 + 2)[0] == []


def test_seen_keeps_only_commits_within_slack_of_the_watermark(root):
    store = open_store(root)
    committed_at(root, 1, T0 + 30 - SLACK - 1)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    assert cursor["seen"] == sorted(f"{RUN}/{s}@{T0 + 10 * s!r}" for s in (2, 3))


def test_a_step_committed_again_lands_again(root):
    store = open_store(root)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    committed_at(root, 3, T0 + 31)  # the same step, a new commit record time
    landed, _ = new_commits(store, cursor, limit=10, now=T0 + 1)
    assert keys(landed) == [name(3)]


def test_an_unreadable_commit_record_lands_without_a_digest(root):
    flip_byte(manifest_path(root, RUN, 2))
    committed_at(root, 2, T0 + 20)
    landed, _ = land(open_store(root), None)
    assert [(c.key, c.digest, c.marker) for c in landed][1] == (name(2), "", f"unreadable-{T0 + 20:.0f}")


def sealed_as(root: str, step: int, version: int) -> None:
    """Step ``step``'s manifest sealed again as ``version``, its commit record time kept."""
    reseal_manifest(root, RUN, step, lambda record: record.update(format_version=version))
    committed_at(root, step, T0 + 10 * step)


def test_a_commit_a_newer_ckptflow_wrote_lands_again_under_its_digest_once_it_reads(root):
    """The rolling upgrade: trainers write a format the code location does not read yet; the
    commit lands unread (its validation says to upgrade), and the first full listing after
    the upgrade lands it under its digest, so it gets the validation it could not have."""
    store = open_store(root)
    readable = max(fmt.READABLE_FORMATS)
    sealed_as(root, 2, readable + 1)
    landed, cursor = new_commits(store, {}, limit=10, now=T0)
    assert [(c.key, bool(c.digest)) for c in landed] == [(name(1), True), (name(2), False), (name(3), True)]
    assert cursor["waiting"] == [[RUN, 2, T0 + 20]]
    again, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert again == [] and cursor["waiting"] == [[RUN, 2, T0 + 20]]  # still newer: still waiting

    sealed_as(root, 2, readable)  # what an upgraded ckptflow reads
    quick, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S + 1)
    assert quick == []  # read again by full listings only
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + 2 * FULL_SCAN_S + 1)
    digest = catalog.read_manifest(store, RUN, 2).digest
    assert [(c.key, c.digest, c.marker, c.validated) for c in landed] == [(name(2), digest, digest[:16], False)]
    assert cursor["waiting"] == []
    assert new_commits(store, cursor, limit=10, now=T0 + 3 * FULL_SCAN_S + 2)[0] == []


def test_an_outage_while_reading_a_waiting_commit_again_keeps_it_waiting(root):
    store = FaultyStore(open_store(root))
    sealed_as(root, 2, max(fmt.READABLE_FORMATS) + 1)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    sealed_as(root, 2, max(fmt.READABLE_FORMATS))
    store.fail_if = lambda op, key: op == "get" and key == fmt.manifest_key(RUN, 2) and _raise_unavailable(key)
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert landed == [] and cursor["waiting"] == [[RUN, 2, T0 + 20]]
    store.fail_if = lambda op, key: False
    landed, _ = new_commits(store, cursor, limit=10, now=T0 + 2 * FULL_SCAN_S)
    assert [(c.key, bool(c.digest)) for c in landed] == [(name(2), True)]


def _raise_unavailable(key: str) -> bool:
    raise StoreUnavailableError(f"GetObject of {key}: SlowDown")


def test_a_waiting_commit_validated_meanwhile_lands_marked_so(root):
    """An operator re-materialized the partition after the upgrade: no second validation run."""
    store = open_store(root)
    sealed_as(root, 2, max(fmt.READABLE_FORMATS) + 1)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    sealed_as(root, 2, max(fmt.READABLE_FORMATS))
    lifecycle.validate(store, RUN, 2)
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert [(c.key, c.validated) for c in landed] == [(name(2), True)] and cursor["waiting"] == []


def test_a_waiting_commit_proved_damaged_lands_again_one_deleted_or_committed_again_is_dropped(root):
    store = open_store(root)
    newer = max(fmt.READABLE_FORMATS) + 1
    for step in (1, 2, 3):
        sealed_as(root, step, newer)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    assert [w[1] for w in cursor["waiting"]] == [1, 2, 3]
    flip_byte(manifest_path(root, RUN, 1))
    committed_at(root, 1, T0 + 10)
    manifest_path(root, RUN, 2).unlink()
    committed_at(root, 3, T0 + 31)  # committed again: a commit of its own, landed as new
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert [(c.key, c.marker) for c in landed] == [
        (name(1), f"damaged-{T0 + 10:.0f}"),
        (name(3), f"unreadable-{T0 + 31:.0f}"),
    ]
    assert cursor["waiting"] == [[RUN, 3, T0 + 31]]


def test_the_cursor_keeps_at_most_max_waiting_unread_commits_the_newest_read_in_turn(root, monkeypatch):
    import ckptflow.lifecycle.landing as landing

    monkeypatch.setattr(landing, "MAX_WAITING", 2)
    store = open_store(root)
    for step in (1, 2, 3):
        sealed_as(root, step, max(fmt.READABLE_FORMATS) + 1)
    _, cursor = new_commits(store, {}, limit=2, now=T0)
    assert [w[1] for w in cursor["waiting"]] == [1, 2]
    # a full tick reads step 1 again (limit 1: it is read last next time) and lands step 3: the oldest goes
    _, cursor = new_commits(store, cursor, limit=1, now=T0 + FULL_SCAN_S)
    assert [w[1] for w in cursor["waiting"]] == [2, 3]
    assert MAX_WAITING >= 1000


def test_a_tick_lands_at_most_limit_commits_read_again_first(root):
    store = open_store(root)
    newer = max(fmt.READABLE_FORMATS) + 1
    sealed_as(root, 1, newer)
    _, cursor = new_commits(store, {}, limit=1, now=T0)
    sealed_as(root, 1, max(fmt.READABLE_FORMATS))
    landed, cursor = new_commits(store, cursor, limit=1, now=T0 + FULL_SCAN_S)
    assert keys(landed) == [name(1)] and cursor["frontier"] == {RUN: 2}  # steps 2 and 3 wait for the next tick
    assert keys(new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S + 1)[0]) == [name(2), name(3)]


def test_a_run_that_could_not_be_listed_keeps_its_waiting_commits(root):
    """Its listing failing is no proof the commit was deleted."""
    store = FaultyStore(open_store(root))
    sealed_as(root, 2, max(fmt.READABLE_FORMATS) + 1)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    store.fail_if = lambda op, key: op.startswith("list") and key.startswith(f"runs/{RUN}/") and _raise_unavailable(key)
    _, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert cursor["waiting"] == [[RUN, 2, T0 + 20]]
    store.fail_if = lambda op, key: False
    sealed_as(root, 2, max(fmt.READABLE_FORMATS))
    landed, _ = new_commits(store, cursor, limit=10, now=T0 + 2 * FULL_SCAN_S)
    assert keys(landed) == [name(2)]


@pytest.mark.parametrize("waiting", [None, 5, "x", [["r", 2]], [["r", "2", 1.0]], [["r", 2, None]], [["r", True, 1.0]]])
def test_a_waiting_value_this_code_never_writes_is_dropped_not_raised_on(root, waiting):
    store = open_store(root)
    _, cursor = land(store, None)
    state = json.loads(cursor)
    state["waiting"] = waiting
    landed, after = land(store, json.dumps(state))
    assert landed == [] and json.loads(after)["waiting"] == []


def test_a_store_that_does_not_answer_stops_the_tick_there_and_the_next_tick_retries(root):
    store = FaultyStore(open_store(root))
    down = {"now": True}

    def unavailable(op, key):
        if down["now"] and op == "get" and key == fmt.manifest_key(RUN, 2):
            raise StoreUnavailableError(f"GetObject of {key}: SlowDown")
        return False

    store.fail_if = unavailable
    landed, cursor = new_commits(store, {}, limit=10, now=T0)
    assert keys(landed) == [name(1)]
    assert cursor["t"] == T0 + 10 and cursor["frontier"] == {RUN: 2}  # step 2 left for the next tick
    down["now"] = False
    landed, _ = new_commits(store, cursor, limit=10, now=T0 + 1)
    assert keys(landed) == [name(2), name(3)]


def test_a_damaged_commit_behind_the_watermark_lands_once_not_at_every_full_listing(root):
    """Each full listing landed it again (a sensor log line, and a run request Dagster
    dropped by its key, every five minutes for as long as it stayed)."""
    store = open_store(root)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    with Checkpointer(root, "copied") as ck:
        ck.save(5, tiny_state(seed=5))
    flip_byte(manifest_path(root, "copied", 5))
    committed_at(root, 5, T0 - 600, run="copied")
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert [(c.key, c.digest) for c in landed] == [(name(5, "copied"), "")]
    assert new_commits(store, cursor, limit=10, now=T0 + 2 * FULL_SCAN_S)[0] == []
    manifest_path(root, "copied", 5).unlink()  # quarantined: nothing left to remember
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + 3 * FULL_SCAN_S)
    assert landed == [] and [p[0] for p in cursor["pending"]] == [RUN, RUN, RUN]  # steps 1-3: not validated


def test_a_waiting_commit_proved_damaged_behind_the_watermark_lands_once(root):
    """Read again and proved damaged, it was dropped from ``waiting`` but not kept
    ``pending``, so the next full listing landed it a second time (as unreadable)."""
    store = open_store(root)
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    with Checkpointer(root, "copied") as ck:
        ck.save(5, tiny_state(seed=5))
    reseal_manifest(root, "copied", 5, lambda record: record.update(format_version=max(fmt.READABLE_FORMATS) + 1))
    committed_at(root, 5, T0 - 600, run="copied")
    _, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert cursor["waiting"] == [["copied", 5, T0 - 600]]
    flip_byte(manifest_path(root, "copied", 5))
    committed_at(root, 5, T0 - 600, run="copied")
    landed, cursor = new_commits(store, cursor, limit=10, now=T0 + 2 * FULL_SCAN_S)
    assert [(c.key, c.marker) for c in landed] == [(name(5, "copied"), f"damaged-{T0 - 600:.0f}")]
    assert new_commits(store, cursor, limit=10, now=T0 + 3 * FULL_SCAN_S)[0] == []


def test_a_full_listing_forgets_the_frontier_of_a_run_gone_from_the_store(root):
    """The cursor stays bounded by the runs the store holds, not every run it ever held,
    and a run of that name made again lands at once, whichever steps it commits."""
    store = open_store(root)
    with Checkpointer(root, "gone") as ck:
        ck.save(50, tiny_state(seed=5))
    _, cursor = new_commits(store, {}, limit=10, now=T0)
    assert cursor["frontier"] == {RUN: 3, "gone": 50}
    lifecycle.expire(store, "gone", 50)  # retention expired the run's last checkpoint
    _, cursor = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S)
    assert cursor["frontier"] == {RUN: 3}
    with Checkpointer(root, "gone") as ck:  # a new training job under the old name
        ck.save(10, tiny_state(seed=6))
    landed, _ = new_commits(store, cursor, limit=10, now=T0 + FULL_SCAN_S + 1)  # a quick tick
    assert keys(landed) == [name(10, "gone")]
