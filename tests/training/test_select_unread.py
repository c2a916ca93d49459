"""A selector that could not read something proves nothing: a read that failed while it
chose (a commit record, a lifecycle record) never passes a step over for an older one."""

from __future__ import annotations

import json
import re

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import recovery_log
from ckptflow.catalog.object_index import PREFIX
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.reports import inventory
from ckptflow.store import open_store
from ckptflow.store.local import LocalStore
from support.cli import run_cli
from support.selection_runs import damage, make, step_2_validated_then_committed_again
from support.states import model_at

STEP_2 = f"{2:0{fmt.STEP_DIGITS}d}"


class ReadFailsOnce(LocalStore):
    """The first read of a key matching ``pattern`` (a regex) fails (an outage), later ones
    read (``always``: every one fails)."""

    def __init__(self, root, pattern, *, always=False):
        super().__init__(root)
        self.pattern, self.failed, self.always = re.compile(pattern), False, always

    def get_bounded(self, key, limit):
        if self.pattern.search(key) and (self.always or not self.failed):
            self.failed = True
            raise StoreUnavailableError(f"{key}: 503 SlowDown, failed after 10 attempts")
        return super().get_bounded(key, limit)


def test_validated_tries_the_hot_copy_it_could_not_read_when_the_archive_holds_another_commit(tmp_path):
    """Step 2's first commit was archived, then rotted and was committed again in the hot store,
    and the new commit passed validation. The selector's read of the hot commit record fails
    once: restore still tries it (it reads now), never passes step 2 over for step 1 by the
    archive's other commit."""
    root, store = make(tmp_path, steps=(1, 2))
    archive = open_store(str(tmp_path / "archive"))
    assert lifecycle.archive(store, archive, "r", 2).ok
    with Checkpointer(root, "r") as ck:
        damage(root, 2)
        ck.restore({"model": model_at(0)})
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.1})
    for step in (1, 2):
        assert lifecycle.validate(store, "r", step)["ok"]
    live = {"model": model_at(0)}
    hot = ReadFailsOnce(root, r"000000000002/manifest\.json$")
    with Checkpointer(hot, "r", tiers=[archive.root]) as ck:
        result = ck.restore(live, select="validated")
    assert hot.failed
    assert (result.step, result.tier, result.passed_over) == (2, store.url, [])
    assert live["model"].weight[0, 0].item() == 2


@pytest.mark.parametrize("what", ["validation", "evaluation"])
def test_a_lifecycle_record_that_could_not_be_read_stops_the_restore(tmp_path, what):
    """Step 2 is validated and evaluated (the best), but its record does not read (an outage
    that outlasted the retries): restore raises StoreUnavailableError rather than recover to
    step 1 saying step 2 is "not validated yet" (or has no evaluation)."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
        lifecycle.evaluate(store, store, "r", step)
    select = "validated" if what == "validation" else "best:val_loss:min"
    live = {"model": model_at(0)}
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/{what}\.json$")
    with Checkpointer(hot, "r") as ck, pytest.raises(StoreUnavailableError, match=f"{what}.json"):
        ck.restore(live, select=select)
    assert hot.failed and live["model"].weight[0, 0].item() == 0
    with Checkpointer(root, "r") as ck:  # the store reads again: step 2, as chosen before the outage
        assert ck.restore(live, select=select).step == 2


def test_the_inventory_says_a_selector_stops_where_a_lifecycle_record_does_not_read(tmp_path):
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
        lifecycle.evaluate(store, store, "r", step)
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/validation\.json$", always=True)  # the inventory reads what it can
    [row] = inventory.recovery_choices(hot, inventory.collect(hot))
    assert row["latest"] == 2 and row["validated"] == row["best"] == "stops (a lifecycle record is unreadable)"


def test_an_unread_record_of_an_older_step_stops_nothing_until_the_walk_reaches_it(tmp_path):
    """Step 1's validation record does not read: 'validated' still recovers to step 2 (validated);
    once step 2 proves damaged, the walk reaches step 1 and stops there (step 1 may be validated)
    rather than say that nothing is."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    step_1 = f"{1:0{fmt.STEP_DIGITS}d}"
    live = {"model": model_at(0)}
    with Checkpointer(ReadFailsOnce(root, rf"/{step_1}/.*/validation\.json$", always=True), "r") as ck:
        assert ck.restore(live, select="validated").step == 2
    damage(root, 2)
    live = {"model": model_at(0)}
    with (
        Checkpointer(ReadFailsOnce(root, rf"/{step_1}/.*/validation\.json$", always=True), "r") as ck,
        pytest.raises(StoreUnavailableError, match=f"could not read the validation record .*{step_1}"),
    ):
        ck.restore(live, select="validated")
    assert live["model"].weight[0, 0].item() == 0


def test_an_unread_record_of_a_commit_no_tier_holds_any_more_stops_nothing(tmp_path):
    """Step 2 was committed again after its first commit's validation; that old record does not
    read: it is about a commit no tier holds, so 'validated' passes step 2 over (its commit there
    now is not validated) and recovers to step 1."""
    root, _ = step_2_validated_then_committed_again(tmp_path)
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/validation\.json$", always=True)
    with Checkpointer(hot, "r") as ck:
        result = ck.restore({"model": model_at(0)}, select="validated")
    assert hot.failed and result.step == 1 and [s for s, _ in result.passed_over] == [2]


def test_ls_select_that_stops_at_an_unread_record_says_so_and_exits_3(tmp_path, monkeypatch, capsys):
    """``ls --select`` went on as if the choice were complete: 'best' with an unread evaluation
    printed 'no checkpoints ... for run r' and exited 0 (before Choice.stop: exit 2, naming the
    record). It lists what restore tries before the stop, says where it stops, and exits 3."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
        lifecycle.evaluate(store, store, "r", step)
    failing = re.compile(rf"/{STEP_2}/.*/(evaluation|validation)\.json$")
    read = LocalStore.get_bounded

    def get_bounded(self, key, limit):
        if failing.search(key):
            raise StoreUnavailableError(f"{key}: 503 SlowDown, failed after 10 attempts")
        return read(self, key, limit)

    monkeypatch.setattr(LocalStore, "get_bounded", get_bounded)
    code, out, err = run_cli(capsys, "ls", root, "--run", "r", "--select", "best:val_loss:min")
    assert code == 3 and "no checkpoints" not in out and "could not read the" in err
    code, out, err = run_cli(capsys, "ls", root, "--run", "r", "--select", "validated", "--json")
    assert code == 3 and json.loads(out) == [] and "could not read the validation record" in err


def test_best_is_not_stopped_by_an_unread_record_that_cannot_rank_its_step(tmp_path):
    """Best stopped at any held step with an unread validation or evaluation record. Step 2 is
    validated but has no score of ``acc`` (not evaluated yet: evaluation runs after validation;
    its trainer recorded val_loss only): its verdict, read or not, cannot make it a candidate,
    so its unread verdict stops nothing and Best recovers to step 1. Nor does an unread
    evaluation of a commit whose verdict read as failed. By val_loss, which its trainer
    recorded, step 2 is scored: its unread verdict may fail it, so that choice stops."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    lifecycle.evaluate(store, store, "r", 1, lambda tensors, info: {"acc": 0.5})
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/validation\.json$", always=True)
    with Checkpointer(hot, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select="best:acc:max").step == 1
        with pytest.raises(StoreUnavailableError, match="could not read the validation record"):
            ck.restore({"model": model_at(0)}, select="best:val_loss:min")
    assert hot.failed

    lifecycle.evaluate(store, store, "r", 2, lambda tensors, info: {"acc": 0.9})
    damage(root, 2)
    lifecycle.validate(store, "r", 2)  # now failed on the commit there
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/evaluation\.json$", always=True)
    with Checkpointer(hot, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select="best:acc:max").step == 1
    assert hot.failed


def test_best_stops_at_an_unread_trainer_record_of_a_commit_not_evaluated(tmp_path):
    """What a trainer reported after the commit (its ``trainer`` record) scores a commit not
    evaluated yet, as retention's best-K reads it: unread, it may hold the best score, so
    Best stops there rather than recovering to step 1 on no proof. Once the commit is
    evaluated (the evaluation wins over it) it stops nothing: step 2 is the best, the one
    on its evaluator's scale (step 1's trainer figure is not compared with it)."""
    root, store = make(tmp_path, steps=(1, 2), val_loss=lambda step: 0.5 if step == 1 else None)
    digest = inventory.collect(store)[1].digest
    lifecycle.write_record(store, lifecycle.Subject("r", 2, digest), "trainer", {"metrics": {"val_loss": 0.1}})
    hot = ReadFailsOnce(root, rf"/{STEP_2}/.*/trainer\.json$", always=True)
    with Checkpointer(hot, "r") as ck:
        with pytest.raises(StoreUnavailableError, match="could not read the trainer record"):
            ck.restore({"model": model_at(0)}, select="best:val_loss:min")
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select="best:val_loss:min").step == 2
    lifecycle.evaluate(store, store, "r", 2, lambda tensors, info: {"val_loss": 0.9})
    store.delete(f"{PREFIX}lifecycle/r.json")  # not known: the trainer record is read again, and fails
    with Checkpointer(hot, "r") as ck:
        result = ck.restore({"model": model_at(0)}, select="best:val_loss:min")
    assert result.step == 2 and [step for step, _ in result.passed_over] == [1]


def test_best_stops_at_a_commit_record_it_could_not_read(tmp_path):
    """Step 2 is not evaluated, but its trainer recorded a val_loss at save (0.1), which scores
    it: while its commit record does not read (an outage), that score is unknown, so Best
    stops rather than recovering to the evaluated step 1 on no proof."""
    root, store = make(tmp_path, steps=(1, 2), val_loss={1: 0.5, 2: 0.1}.get)
    lifecycle.evaluate(store, store, "r", 1)
    hot = ReadFailsOnce(root, rf"/{STEP_2}/manifest\.json$", always=True)
    with Checkpointer(hot, "r") as ck:
        with pytest.raises(StoreUnavailableError, match=rf"could not read the commit record .*{STEP_2}/manifest"):
            ck.restore({"model": model_at(0)}, select="best:val_loss:min")
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select="best:val_loss:min").step == 2


@pytest.mark.parametrize("unread", [r"/.*/validation\.json$", r"/manifest\.json$"])
def test_a_restore_stopped_by_an_unread_step_keeps_what_it_passed_over_and_skipped(tmp_path, unread):
    """Step 4 is not validated, step 3 is validated but damaged, step 2's verdict (or its
    commit record) does not read: 'validated' passes 4 over, skips 3, and stops at 2. The error
    and the recovery record the operator reads say so (they said ``passed_over: []``,
    ``skipped: []``)."""
    root, store = make(tmp_path, steps=(1, 2, 3, 4))
    for step in (1, 2, 3):
        lifecycle.validate(store, "r", step)
    damage(root, 3)
    hot = ReadFailsOnce(root, rf"/{STEP_2}{unread}", always=True)
    with Checkpointer(hot, "r") as ck, pytest.raises(StoreUnavailableError, match="stopped") as raised:
        ck.restore({"model": model_at(0)}, select="validated")
    assert raised.value.passed_over == [(4, "not validated yet")]
    assert [s for s, _ in raised.value.skipped] == [3]
    [record] = recovery_log.read_all(store, "r")
    assert record["ok"] is False and record["passed_over"] == [[4, "not validated yet"]]
    assert [s for s, _ in record["skipped"]] == [3]
