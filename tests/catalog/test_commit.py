"""Saving over a step: a manifest already there is moved aside only when it is proved damaged
(when the save begins, and at commit under the run's lock for any other version found
then); a valid one never is (``ckptflow.catalog.commit``)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, CheckpointExistsError, StoreUnavailableError, open_store
from ckptflow.format import layout as fmt
from support.corrupt import corrupt_chunk, manifest_path, only_in
from support.faulty_store import FaultyStore

RUN = "r"
TESTS = Path(__file__).parents[1]


def state(value: float) -> dict:
    return {"w": torch.full((64,), value), "v": torch.full((32,), -value)}


def with_damaged_step_2(root: str, run: str = RUN) -> bytes:
    """Steps 1 and 2 committed, then a chunk only step 2 uses damaged (its last byte flipped,
    through the store on S3): the manifest of 2."""
    with Checkpointer(root, run) as ck:
        ck.save(1, state(1.0))
        ck.save(2, state(2.0))
    if "://" not in root:
        corrupt_chunk(root, run, 2)
    else:
        store = open_store(root)
        key = fmt.chunk_key(only_in(root, run, 2, 1)[0])
        blob = bytearray(store.get(key))
        blob[-1] ^= 0xFF
        store.replace(key, bytes(blob))
    return manifest_of(root, run, 2)


def manifest_of(root: str, run: str, step: int) -> bytes:
    return open_store(root).get(fmt.manifest_key(run, step))


def restored(root, run: str = RUN) -> Checkpointer:
    """A Checkpointer that restored past the damaged step 2, as a restarted job does."""
    ck = Checkpointer(root, run)
    result = ck.restore(state(0.0))
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    return ck


def quarantined(root, run: str = RUN) -> list[str]:
    """Digests of the manifests in quarantine."""
    store = open_store(root)
    return sorted(fmt.digest_of(store.get(i.key)) for i in store.list(f"runs/{run}/quarantine/"))


def values_at(root, step: int, run: str = RUN) -> float:
    with Checkpointer(root, run) as ck:
        assert ck.verify(step).ok
        loaded = state(0.0)
        ck.restore(loaded, step=step)
        return float(loaded["w"][0])


def save(ck: Checkpointer, step: int, value: float, *, blocking: bool) -> None:
    done = ck.save(step, state(value), blocking=blocking)
    if not blocking:
        done.wait()  # type: ignore[union-attr]


def root_on(backend: str, request, tmp_path) -> str:
    return str(tmp_path / "store") if backend == "local" else request.getfixturevalue("s3_store_url")


@pytest.mark.parametrize(("backend", "blocking"), [("local", True), ("local", False), ("s3", True)])
def test_a_valid_commit_of_another_checkpointer_is_never_quarantined(backend, blocking, request, tmp_path):
    store_url = root_on(backend, request, tmp_path)
    damaged = with_damaged_step_2(store_url)
    a, b = restored(store_url), restored(store_url)
    try:
        save(a, 2, 20.0, blocking=blocking)
        committed = manifest_of(store_url, RUN, 2)
        with pytest.raises(CheckpointExistsError) as refused:
            save(b, 2, 30.0, blocking=blocking)
    finally:
        a.close()
        b.close()
    message = str(refused.value)
    assert f"step 2 of run {RUN!r}" in message and fmt.digest_of(committed) in message
    assert manifest_of(store_url, RUN, 2) == committed  # A's commit, exactly as it was
    assert quarantined(store_url) == [fmt.digest_of(damaged)]
    assert values_at(store_url, 2) == 20.0


@pytest.mark.parametrize("blocking", [True, False])
def test_the_same_checkpointer_saving_a_step_twice_is_refused(tmp_path, blocking):
    root = str(tmp_path / "store")
    damaged = with_damaged_step_2(root)
    with restored(root) as ck:
        save(ck, 2, 20.0, blocking=blocking)
        committed = manifest_path(root, RUN, 2).read_bytes()
        with pytest.raises(CheckpointExistsError, match="already committed"):
            save(ck, 2, 21.0, blocking=blocking)
    assert manifest_path(root, RUN, 2).read_bytes() == committed
    assert quarantined(root) == [fmt.digest_of(damaged)]
    assert values_at(root, 2) == 20.0


def test_a_damaged_step_stays_in_place_until_the_save_that_replaces_it_commits(tmp_path):
    root = str(tmp_path / "store")
    damaged = with_damaged_step_2(root)
    store = FaultyStore(open_store(root))
    commit = store.pause_before("put_if_absent", lambda key: key == fmt.manifest_key(RUN, 2))
    with Checkpointer(store, RUN) as ck:
        assert ck.restore(state(0.0)).step == 1
        handle = ck.save(2, state(20.0), blocking=False)
        assert commit.reached.wait(30)
        assert manifest_path(root, RUN, 2).read_bytes() == damaged  # nothing moved before the commit
        commit.release()
        handle.wait()
    assert quarantined(root) == [fmt.digest_of(damaged)]
    assert values_at(root, 2) == 20.0


def test_a_step_repaired_since_restore_rejected_it_is_kept(tmp_path):
    """Restore rejected it, but by commit its chunk is whole again: no proof, no move."""
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, state(1.0))
        ck.save(2, state(2.0))
    digest = corrupt_chunk(root, RUN, 2)
    good = manifest_path(root, RUN, 2).read_bytes()
    with restored(root) as ck:
        corrupt_chunk(root, RUN, 2, digest)  # flipped back: whole again
        with pytest.raises(CheckpointExistsError, match="verifies"):
            ck.save(2, state(20.0))
    assert manifest_path(root, RUN, 2).read_bytes() == good and quarantined(root) == []
    assert values_at(root, 2) == 2.0


@pytest.mark.parametrize("when", ["before writing", "at commit"])
def test_an_existing_manifest_that_cannot_be_read_changes_nothing(tmp_path, when):
    root = str(tmp_path / "store")
    damaged = with_damaged_step_2(root)
    key = fmt.manifest_key(RUN, 2)
    store = FaultyStore(open_store(root))
    writing = threading.Event()

    def outage(op: str, target: str) -> bool:
        if target.startswith("chunks/"):
            writing.set()  # past the check before writing: the commit is next
        return (when == "before writing" or writing.is_set()) and target == key and op in ("get", "stat")

    with Checkpointer(store, RUN) as ck:
        assert ck.restore(state(0.0)).step == 1
        chunks_before = {i.key for i in store.inner.list("chunks/")}
        store.fail_if = outage
        with pytest.raises(StoreUnavailableError, match="step 2"):
            ck.save(2, state(20.0))
    assert manifest_path(root, RUN, 2).read_bytes() == damaged and quarantined(root) == []
    if when == "before writing":
        assert {i.key for i in store.inner.list("chunks/")} == chunks_before


@pytest.mark.parametrize(("backend", "rounds"), [("local", 4), ("s3", 1)])
def test_savers_racing_to_replace_a_damaged_step_in_threads_one_wins(backend, rounds, request, tmp_path):
    store_url = root_on(backend, request, tmp_path)
    for round_ in range(rounds):
        run = f"race{round_}"
        damaged = with_damaged_step_2(store_url, run)
        outcomes = race_in_threads(store_url, run, 4)
        assert sorted(outcomes) == ["committed", "exists", "exists", "exists"], outcomes
        assert quarantined(store_url, run) == [fmt.digest_of(damaged)]  # never a valid commit
        assert values_at(store_url, 2, run) == 10.0 + outcomes.index("committed")


def race_in_threads(root: str, run: str, n: int) -> list[str]:
    """``n`` Checkpointers restore past the damaged step 2, then all save it at once (each
    up to 30 ms late, so some start after another has committed): what each one's save did."""
    savers = [restored(root, run) for _ in range(n)]
    barrier = threading.Barrier(n)
    outcomes = [""] * n

    def race(i: int) -> None:
        barrier.wait()
        time.sleep(random.uniform(0, 0.03))
        try:
            savers[i].save(2, state(10.0 + i))
            outcomes[i] = "committed"
        except CheckpointExistsError:
            outcomes[i] = "exists"

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for ck in savers:
        ck.close()
    return outcomes


@pytest.mark.slow  # spawned saver processes (~14 s; the threaded race stays in make test): make test-e2e
def test_savers_racing_to_replace_a_damaged_step_in_processes_one_wins(tmp_path):
    root = str(tmp_path / "store")
    damaged = with_damaged_step_2(root)
    go = tmp_path / "go"
    script = str(TESTS / "support" / "step_replacer.py")
    children = [  # two at once; the third a second later, after one of them has committed
        subprocess.Popen(
            [sys.executable, script, root, RUN, "2", str(10.0 + i), str(go), str(delay)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, delay in enumerate([0.0, 0.0, 1.0])
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        go.touch()
        outcomes = [child.communicate(timeout=120)[0].strip() for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert sorted(outcomes) == ["committed", "exists", "exists"], outcomes
    assert quarantined(root) == [fmt.digest_of(damaged)]
    assert values_at(root, 2) == 10.0 + outcomes.index("committed")
    assert not [p for p in Path(root).rglob(".tmp-*")]  # nothing left half-moved
    assert os.path.exists(manifest_path(root, RUN, 2))
