"""``Best`` ranks by the score retention's best-K, promotion and the inventory rank by
(``ckptflow.policy.scores``): the evaluation's, else what the trainer reported after the
commit (its ``trainer`` record), else at save (its metadata)."""

from __future__ import annotations

import json
import time

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.object_index import PREFIX
from ckptflow.catalog.selection import Best
from ckptflow.errors import PromotionError
from ckptflow.lifecycle.promote import choose_checkpoint
from ckptflow.policy.retention import DAY, KeepBestK
from ckptflow.reports import inventory
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import flip_byte, manifest_path
from support.faulty_store import FaultyStore
from support.selection_runs import damage, make
from support.states import model_at

LATER = time.time() + 100 * DAY  # every checkpoint is old: only best-K (and the never-delete rules) keeps one


def bests(root, store, capsys) -> dict[str, int | None]:
    """The step each reader takes for the best by min val_loss."""
    entries = inventory.collect(store)
    plan = inventory.retention_plan(entries, LATER, policy=KeepBestK("val_loss", k=1))
    with Checkpointer(root, "r") as ck:
        restored = ck.restore({"model": model_at(0)}, select=Best("val_loss", "min")).step
    [row] = inventory.recovery_choices(store, entries)
    _, out, _ = run_cli(capsys, "ls", root, "--run", "r", "--select", "best:val_loss:min", "--json")
    return {
        "restore": restored,
        "ls": json.loads(out)[0]["step"],
        "inventory": row["best"],
        "retention": next(step for (_, step), why in plan.keep.items() if any("best 1 of" in w for w in why)),
        "promotion": choose_checkpoint(entries, "val_loss", "min")[0].step,
    }


def test_before_and_after_an_evaluation_every_reader_takes_the_same_best(tmp_path, capsys):
    """Before any evaluation, retention kept step 4 as the best (its trainer reported 0.2
    after the commit; steps 1 to 3 recorded 0.9, 0.4, 0.6 at save) while restore's "best"
    found no checkpoint with a score (NoValidCheckpointError: "no evaluation of 'val_loss'"
    for every step) and the inventory's recover_to said None. Once step 1 is evaluated at
    0.1, the evaluation wins over its trainer's 0.9 everywhere."""
    root, store = make(tmp_path, steps=(1, 2, 3, 4), val_loss={1: 0.9, 2: 0.4, 3: 0.6}.get)
    entries = inventory.collect(store)
    lifecycle.write_record(
        store, lifecycle.Subject("r", 4, entries[3].digest), "trainer", {"metrics": {"val_loss": 0.2}, "changes": {}}
    )
    for step in (1, 2, 3, 4):
        assert lifecycle.validate(store, "r", step)["ok"]
    assert set(bests(root, store, capsys).values()) == {4}
    lifecycle.evaluate(store, store, "r", 1, lambda tensors, info: {"val_loss": 0.1})
    assert set(bests(root, store, capsys).values()) == {1}


def test_until_every_step_is_evaluated_the_best_is_the_best_evaluated(tmp_path, capsys):
    """Steps 1 and 2 evaluated (the evaluator's loss: 2.1, 2.5), steps 3 and 4 not yet
    (their trainer's loss at save: 0.6, 0.5). "The evaluation wins, else the trainer's"
    ranked 2.1 against 0.5, an evaluation loss against a training loss: step 4 was the best
    everywhere for its figure's scale, not its quality. Now they rank on the evaluator's
    scale only; steps 3 and 4 are passed over, saying why, until they are evaluated."""
    root, store = make(tmp_path, steps=(1, 2, 3, 4), val_loss={1: 0.9, 2: 0.4, 3: 0.6, 4: 0.5}.get)
    for step in (1, 2, 3, 4):
        assert lifecycle.validate(store, "r", step)["ok"]
    for step, loss in ((1, 2.1), (2, 2.5)):
        lifecycle.evaluate(store, store, "r", step, lambda tensors, info, loss=loss: {"val_loss": loss})
    assert set(bests(root, store, capsys).values()) == {1}
    with Checkpointer(root, "r") as ck:
        passed = dict(ck.restore({"model": model_at(0)}, select=Best("val_loss", "min")).passed_over)
    assert "scored on the trainer's figures only, not on evaluator's figures" in passed[4] and 3 in passed
    lifecycle.evaluate(store, store, "r", 4, lambda tensors, info: {"val_loss": 2.0})
    assert set(bests(root, store, capsys).values()) == {4}


def test_a_best_restore_rewrites_no_index_it_did_not_change(tmp_path):
    """Step 3's commit record is damaged (its summary cannot be derived, so the run's
    summary index never holds it): every restore by "best" wrote that index back, the same
    entries again, because the index held fewer entries than the listing showed. Now an
    index is written only when what it holds changes."""
    root, store = make(tmp_path, steps=(1, 2, 3), val_loss={1: 0.9, 2: 0.4, 3: 0.6}.get)
    for step in (1, 2):
        assert lifecycle.validate(store, "r", step)["ok"]
    flip_byte(manifest_path(root, "r", 3))
    counted = FaultyStore(open_store(root))

    def best() -> int:
        with Checkpointer(counted, "r") as ck:
            return ck.restore({"model": model_at(0)}, select=Best("val_loss", "min")).step

    assert best() == 2  # the first builds the indexes
    before = len(counted.log)
    assert best() == 2 and best() == 2
    assert [key for _, op, key in counted.log[before:] if key.startswith(PREFIX)] == []


def test_an_evaluation_of_a_commit_no_tier_holds_chooses_no_scale(tmp_path):
    """Step 2's first commit was evaluated (0.1), rotted and was committed again (its trainer:
    0.3); nothing else is evaluated. Best counted the evaluation of the commit no tier holds,
    chose its evaluator's scale, passed over step 1 ("scored on the trainer's figures only")
    and the new step 2 (its scored commit is not there): restore found no best while
    retention and promotion, ranking the commits held, took step 2 by its trainer's 0.3."""
    root, store = make(tmp_path, steps=(1, 2), val_loss={1: 0.5, 2: 0.2}.get)
    for step in (1, 2):
        assert lifecycle.validate(store, "r", step)["ok"]
    lifecycle.evaluate(store, store, "r", 2, lambda tensors, info: {"val_loss": 0.1})
    damage(root, 2)
    with Checkpointer(root, "r", chunk_bytes=256) as ck:
        assert ck.restore({"model": model_at(0)}).step == 1
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.3})
    assert lifecycle.validate(store, "r", 2)["ok"]
    entries = inventory.collect(store)
    plan = inventory.retention_plan(entries, LATER, policy=KeepBestK("val_loss", k=1))
    assert any("best 1 of 2" in why for why in plan.keep[("r", 2)])
    assert choose_checkpoint(entries, "val_loss", "min")[0].step == 2
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select=Best("val_loss", "min")).step == 2
    [row] = inventory.recovery_choices(store, entries)
    assert row["best"] == 2


def test_best_and_promotion_rank_on_the_same_scale_while_the_evaluated_step_is_not_validated(tmp_path, capsys):
    """Steps 1 and 2 validated, scored by their trainer only (0.4, 0.3); step 3 evaluated by
    team.eval (2.0), not validated yet. Best chose its scale among the commits the tiers hold
    (team.eval's) and took step 3; promotion chose it among the validated ones only (the
    trainer's) and took step 2 by its training loss, ranking a run on another scale than
    Best. Now both choose it among the commits that may rank: promotion picks no step until
    step 3 is validated (saying why, in Best's words), then both take step 3."""
    root, store = make(tmp_path, steps=(1, 2, 3), val_loss={1: 0.4, 2: 0.3, 3: 0.5}.get)
    for step in (1, 2):
        assert lifecycle.validate(store, "r", step)["ok"]
    lifecycle.evaluate(store, store, "r", 3, lambda tensors, info: {"val_loss": 2.0}, evaluator_name="team.eval")
    with Checkpointer(root, "r") as ck:
        best = ck.restore({"model": model_at(0)}, select=Best("val_loss", "min"))
    assert best.step == 3
    with pytest.raises(PromotionError, match="on team.eval's figures") as refused:
        choose_checkpoint(inventory.collect(store), "val_loss", "min")
    for step, why in best.passed_over:
        assert f"run 'r' step {step}: {why}" in str(refused.value)
    assert "run 'r' step 3: not validated yet" in str(refused.value)
    assert lifecycle.validate(store, "r", 3)["ok"]
    assert set(bests(root, store, capsys).values()) == {3}


def test_a_best_restore_lists_a_tier_holding_none_of_the_run_once(tmp_path):
    """Nothing of run "r" archived yet: restore listed the archive for its candidates, found
    none, and Best listed it again to read its index of their metadata (two listings per
    restore by "best"). A tier holding none of the steps is read once now."""
    root, store = make(tmp_path, steps=(1, 2), val_loss={1: 0.4, 2: 0.3}.get)
    archive = FaultyStore(open_store(str(tmp_path / "archive")), count_reads=True)
    with Checkpointer(root, "r", tiers=[archive]) as ck:
        assert ck.restore({"model": model_at(0)}, select=Best("val_loss", "min")).step == 2
    listing = [("list_after", "runs/r/checkpoints/"), ("exists", "runs/r/checkpoints")]  # no step: is the run there?
    assert [(op, key) for _, op, key in archive.log] == listing


def test_the_archive_index_ranks_an_earlier_commit_of_a_step_the_hot_tier_holds(tmp_path):
    """Why Best reads the archive's index although the hot tier holds every step the archive
    holds: step 2 was archived (its trainer: 0.1), rotted and was committed again (0.9). Only
    the archive's index says it holds the earlier commit and what that commit scored."""
    root, store = make(tmp_path, steps=(1, 2), val_loss={1: 0.5, 2: 0.1}.get)
    archive = open_store(str(tmp_path / "archive"))
    for step in (1, 2):
        assert lifecycle.archive(store, archive, "r", step).ok
    damage(root, 2)
    with Checkpointer(root, "r", chunk_bytes=256) as ck:
        assert ck.restore({"model": model_at(0)}).step == 1
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.9})
    with Checkpointer(root, "r", tiers=[archive]) as ck:
        result = ck.restore({"model": model_at(0)}, select=Best("val_loss", "min"))
    assert (result.step, result.tier, result.metadata["val_loss"]) == (2, archive.url, 0.1)
