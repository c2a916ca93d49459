"""What a restore recovers to: ``validated`` passes over newer checkpoints that failed or
were never validated, ``best`` orders by an evaluation metric and falls back to the next
best, a registry alias follows promotions and rollbacks; each falls back only within its
own meaning and says why, in the result and in the recovery record."""

from __future__ import annotations

import json

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import recovery_log, selection
from ckptflow.catalog.selection import Alias, Best
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CheckpointExistsError, NewerFormatError, NoValidCheckpointError, StoreUnavailableError
from ckptflow.format.layout import READABLE_FORMATS
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.reports import inventory
from ckptflow.reports.recoveries import run_metrics
from ckptflow.store import open_store
from ckptflow.store.local import LocalStore
from support import selection_runs
from support.cli import run_cli
from support.corrupt import reseal_manifest
from support.selection_runs import damage
from support.states import model_at

VAL_LOSS = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.7}
NO_SCORE = "no score of 'val_loss' (evaluated, or reported by its trainer)"


def make(tmp_path, steps=(1, 2, 3, 4)):
    return selection_runs.make(tmp_path, steps, VAL_LOSS.get)


def restored(root, **kwargs):
    live = {"model": model_at(0)}
    with Checkpointer(root, "r") as ck:
        result = ck.restore(live, **kwargs)
    assert live["model"].weight[0, 0].item() == result.step  # the loaded values are that step's
    return result


def test_validated_passes_over_a_failed_and_an_unvalidated_newer_checkpoint(tmp_path):
    root, store = make(tmp_path)
    damage(root, 3)
    for step in (1, 2, 3):
        lifecycle.validate(store, "r", step)
    assert restored(root).step == 4  # latest: today's behaviour
    result = restored(root, select="validated")
    assert result.step == 2 and result.select == "validated" and result.skipped == []
    assert [s for s, _ in result.passed_over] == [4, 3]
    assert result.passed_over[0][1] == "not validated yet"
    assert result.passed_over[1][1].startswith("failed validation: ")
    record = recovery_log.read_all(store, "r")[-1]
    assert record["select"] == "validated" and [s for s, _ in record["passed_over"]] == [4, 3]

    damage(root, 2)  # validated, then damaged: the next validated one, never the unvalidated 4
    result = restored(root, select="validated")
    assert result.step == 1 and result.fell_back and [s for s, _ in result.skipped] == [2]
    damage(root, 1)
    with pytest.raises(NoValidCheckpointError, match="'validated' and whole"):
        restored(root, select="validated")
    assert run_metrics(store, "r").selectors == {"latest": 1, "validated": 3}


def test_validated_means_this_exact_commit(tmp_path):
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    with Checkpointer(root, "r") as ck:  # step 2 committed again (restore rejected it): a new commit, no verdict
        damage(root, 2)
        ck.restore({"model": model_at(0)})
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.1})
    result = restored(root, select="validated")
    assert result.step == 1
    [(step, why)] = result.passed_over
    assert step == 2 and why.startswith("validation passed on commit ") and "not the commit there now" in why


class ManifestReadFailsOnce(LocalStore):
    """The step-2 commit record does not read once (an outage the selector meets), then does."""

    def __init__(self, root, error):
        super().__init__(root)
        self.error = error

    def get_bounded(self, key, limit):
        if key.endswith("000000000002/manifest.json") and self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().get_bounded(key, limit)


@pytest.mark.parametrize("error", [StoreUnavailableError("503, 10 attempts"), OSError(5, "Input/output error")])
def test_validated_never_loads_another_commit_than_the_validated_one_after_a_read_fails(tmp_path, error):
    """The selector could not read which commit step 2 holds now, so it left the step to
    restore, whose read then succeeded: restore loads only a commit the selector accepted."""
    root, store = selection_runs.step_2_validated_then_committed_again(tmp_path, val_loss=0.1)
    live = {"model": model_at(0)}
    with Checkpointer(ManifestReadFailsOnce(root, error), "r") as ck:
        result = ck.restore(live, select="validated")
    assert result.step == 1 and live["model"].weight[0, 0].item() == 1
    [(step, why)] = result.passed_over
    assert step == 2 and why.startswith("the selector accepted commit ") and "not the commit there now" in why


def test_a_failed_verdict_of_an_earlier_commit_does_not_label_the_commit_there_now(tmp_path):
    """Step 2's first commit failed validation; training saved step 2 again: the new commit
    is not validated yet, not "failed validation" (a verdict is about its commit)."""
    root, store = make(tmp_path, steps=(1, 2))
    lifecycle.validate(store, "r", 1)
    damage(root, 2)
    assert lifecycle.validate(store, "r", 2)["ok"] is False
    assert restored(root, select="validated").passed_over[0][1].startswith("failed validation: ")
    with Checkpointer(root, "r") as ck:
        ck.restore({"model": model_at(0)})
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.1})
    result = restored(root, select="validated")
    assert result.step == 1 and result.passed_over == [(2, "not validated yet")]


def test_best_does_not_label_the_commit_there_now_by_an_earlier_commit_s_failed_verdict(tmp_path, caplog):
    """Step 2's first commit was evaluated, then failed validation; training saved step 2 again
    and the new commit has no score yet (not evaluated, no metric from its trainer): "best"
    passes it over for that, not as "failed validation" (which would also tell a save it may
    replace the whole new commit), and warns that a save of step 2 will be refused."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.evaluate(store, store, "r", step)
    damage(root, 2)
    assert lifecycle.validate(store, "r", 2)["ok"] is False
    with Checkpointer(root, "r") as ck:
        ck.restore({"model": model_at(0)})
        ck.save(2, {"model": model_at(2)})
    with caplog.at_level("WARNING", logger="ckptflow"):
        result = restored(root, select=Best("val_loss", "min"))
    assert result.step == 1 and result.passed_over == [(2, NO_SCORE)]
    assert "holds newer checkpoints (step 2)" in caplog.text


def test_a_verdict_or_evaluation_names_an_earlier_commit_than_one_a_newer_ckptflow_wrote(tmp_path):
    """Step 2 validated and evaluated, then committed again by a newer ckptflow (its record
    reads only there): "validated" and "best" pass over it to what they accept, saying why,
    where "latest" stops at it and says to upgrade."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
        lifecycle.evaluate(store, store, "r", step)
    reseal_manifest(root, "r", 2, lambda record: record.update(format_version=max(READABLE_FORMATS) + 1))
    with pytest.raises(NewerFormatError):
        restored(root)
    for select, what in (("validated", "validation passed on"), (Best("val_loss", "min"), "scored")):
        result = restored(root, select=select)
        [(step, why)] = result.passed_over
        assert result.step == 1 and step == 2
        assert why.startswith(f"{what} commit ")
        assert why.endswith("not the commit there now (one a newer ckptflow wrote)")


@pytest.mark.parametrize("again", ["newer format", "new commit"])
def test_validated_finds_the_validated_commit_in_the_archive_when_hot_holds_another(tmp_path, again):
    """Step 2 validated and archived, then committed again in the hot store: the archive copy
    is the commit the verdict names, so "validated" restores it from there."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    for step in (1, 2):
        assert lifecycle.archive(store, open_store(str(tmp_path / "archive")), "r", step).ok
    if again == "newer format":
        reseal_manifest(root, "r", 2, lambda record: record.update(format_version=max(READABLE_FORMATS) + 1))
    else:
        with Checkpointer(root, "r") as ck:
            damage(root, 2)
            ck.restore({"model": model_at(0)})
            ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.1})
    live = {"model": model_at(0)}
    with Checkpointer(root, "r", tiers=[str(tmp_path / "archive")]) as ck:
        result = ck.restore(live, select="validated")
    assert (result.step, result.tier, result.passed_over) == (2, str(open_store(str(tmp_path / "archive")).url), [])
    assert live["model"].weight[0, 0].item() == 2


def test_validated_falls_back_to_the_lossy_archive_copy_of_the_validated_commit(tmp_path):
    """A lossy copy is named by the commit it was made from (``source_digest``): with
    allow_lossy it is what "validated" recovers to when the hot copy rots."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    archive = open_store(str(tmp_path / "archive"))
    assert lifecycle.archive(store, archive, "r", 2, codec=ArchiveCodec.parse("bf16")).ok
    damage(root, 2)
    live = {"model": model_at(0)}
    with Checkpointer(root, "r", tiers=[str(tmp_path / "archive")]) as ck:
        result = ck.restore(live, select="validated", allow_lossy=True)
    assert (result.step, result.tier, result.passed_over) == (2, archive.url, [])
    assert result.lossy is not None and live["model"].weight[0, 0].item() == 2


def test_best_picks_by_metric_and_falls_back_to_the_next_best(tmp_path):
    root, store = make(tmp_path, steps=(1, 2, 3, 4, 5))  # step 5: no val_loss at all
    for step in (1, 2, 3):  # step 4 never evaluated: ranked by its trainer's val_loss (0.7)
        lifecycle.evaluate(store, store, "r", step)
    result = restored(root, select=Best("val_loss", "min"))
    assert result.step == 2 and result.select == "best:val_loss:min"
    assert result.passed_over == [(5, NO_SCORE)]
    assert restored(root, select=Best("val_loss", "max")).step == 1
    damage(root, 2)
    result = restored(root, select="best:val_loss")
    assert result.step == 3 and [s for s, _ in result.skipped] == [2]  # the next best, not the newest
    with Checkpointer(root, "r") as ck:
        loaded, state = ck.load(select=Best("val_loss"))
    assert loaded.step == 3 and state["model"]["weight"][0, 0].item() == 3


def test_an_alias_restore_follows_a_promotion_and_a_rollback(tmp_path):
    root, store = make(tmp_path)
    registry = Registry(store)
    promote(store, registry, PromotionRequest("m", ("r", 1), stage="stable"))
    assert restored(root, select=Alias("m", "stable")).step == 1
    promote(store, registry, PromotionRequest("m", ("r", 3), stage="stable"))
    result = restored(root, select="m@stable")
    assert result.step == 3 and result.select == "m@stable"
    registry.rollback("m")
    assert restored(root, select=Alias("m", "stable")).step == 1
    assert restored(root, select=Alias("m", "fallback")).step == 3
    damage(root, 1)  # the stable commit is damaged: its fallback, never the newest step 4
    result = restored(root, select=Alias("m", "stable"))
    assert result.step == 3 and [s for s, _ in result.skipped] == [1]
    other = str(tmp_path / "registry")
    with pytest.raises(NoValidCheckpointError, match="has no aliases"):
        restored(root, select=Alias("m", "stable", registry=other))


def test_selectors_parse_and_bad_ones_are_refused_before_reading(tmp_path):
    assert selection.parse("best:acc:max") == Best("acc", "max")
    assert selection.parse("m@fallback") == Alias("m", "fallback")
    assert selection.parse("7") == 7 and selection.parse("validated") == "validated"
    root, _ = make(tmp_path, steps=(1, 2))
    assert restored(root, select=1).step == 1
    with pytest.raises(ValueError, match="not one of"):
        restored(root, select="newest")
    with pytest.raises(ValueError, match="not both"):
        restored(root, step=1, select="validated")
    with pytest.raises(ValueError, match="'min' or 'max'"):
        Best("val_loss", "up")
    with pytest.raises(ValueError, match=r"names a checkpoint \(<run>@<step>\).*--run gpt-small --step 1200"):
        selection.parse("gpt-small@1200")  # a partition key pasted where a selector goes


def test_ls_filters_and_orders_as_restore_would(tmp_path, capsys):
    root, store = make(tmp_path)
    for step in (1, 2, 3):
        lifecycle.evaluate(store, store, "r", step)
    lifecycle.validate(store, "r", 1)
    lifecycle.validate(store, "r", 3)
    code, out, err = run_cli(capsys, "ls", root, "--run", "r", "--select", "validated", "--json")
    assert code == 0 and [d["step"] for d in json.loads(out)] == [3, 1]
    assert "step 4: not validated yet" in err and "step 2: not validated yet" in err
    code, out, _ = run_cli(capsys, "ls", root, "--run", "r", "--select", "best:val_loss:min", "--json")
    assert [d["step"] for d in json.loads(out)] == [2, 3, 4, 1]  # step 4 by its trainer's val_loss
    code, _, err = run_cli(capsys, "ls", root, "--select", "validated")
    assert code == 2 and "give --run too" in err
    code, _, err = run_cli(capsys, "ls", root, "--run", "r", "--select", "newest")
    assert code == 2 and "not one of" in err


def test_training_on_from_a_validated_step_replaces_the_failed_one_but_not_a_whole_one(tmp_path):
    root, store = make(tmp_path)
    damage(root, 3)
    for step in (1, 2, 3):
        lifecycle.validate(store, "r", step)
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": model_at(0)}, select="validated").step == 2
        ck.save(3, {"model": model_at(3)})  # step 3 failed validation: proved damaged, so replaced
        with pytest.raises(CheckpointExistsError):
            ck.save(4, {"model": model_at(4)})  # step 4 is whole (only not validated yet): never overwritten
        assert ck.verify(3).ok


def test_a_re_evaluation_changes_what_best_recovers_to(tmp_path):
    root, store = make(tmp_path)
    for step in (1, 2, 3, 4):
        lifecycle.evaluate(store, store, "r", step)
    assert restored(root, select=Best("val_loss")).step == 2
    # a new evaluator (a backfill re-evaluating old checkpoints) scores by the weights: step 4 is best now
    for step in (1, 2, 3, 4):
        lifecycle.evaluate(store, store, "r", step, lambda tensors, info: {"val_loss": -float(tensors["weight"][0, 0])})
    assert restored(root, select=Best("val_loss")).step == 4


@pytest.mark.parametrize("with_archive", [False, True])
def test_best_ranks_a_step_committed_twice_by_the_commit_each_tier_holds(tmp_path, with_archive):
    """Step 2's first commit scored 0.1, rotted and was committed again, scoring 0.9: "best"
    ranks the commit there now at 0.9 (behind step 3's 0.4), never at its predecessor's 0.1;
    the archive copy of the first commit still ranks first, from the archive."""
    root = str(tmp_path / "store")
    archive = open_store(str(tmp_path / "archive"))
    with Checkpointer(root, "r", chunk_bytes=256) as ck:
        for step, loss in ((1, 0.5), (2, 0.1)):
            ck.save(step, {"model": model_at(step)}, metadata={"val_loss": loss})
    store = open_store(root)
    for step in (1, 2):
        lifecycle.evaluate(store, store, "r", step)
    if with_archive:
        assert lifecycle.archive(store, archive, "r", 2).ok
    damage(root, 2)
    with Checkpointer(root, "r", chunk_bytes=256) as ck:
        assert ck.restore({"model": model_at(0)}).step == 1  # rejects step 2: a save may replace it
        ck.save(2, {"model": model_at(22)}, metadata={"val_loss": 0.9})
        ck.save(3, {"model": model_at(3)}, metadata={"val_loss": 0.4})
    for step in (2, 3):
        lifecycle.evaluate(store, store, "r", step)
    live = {"model": model_at(0)}
    tiers = [archive.root] if with_archive else []
    with Checkpointer(root, "r", tiers=tiers) as ck:
        result = ck.restore(live, select=Best("val_loss", "min"))
    expected = (2, archive.url, 2.0) if with_archive else (3, store.url, 3.0)
    assert (result.step, result.tier, live["model"].weight[0, 0].item()) == expected
    [row] = inventory.recovery_choices(store, inventory.collect(store, archive if with_archive else None))
    assert row["best"] == expected[0]


def test_an_alias_falls_back_to_the_fallback_commit_of_the_same_step_in_the_archive(tmp_path):
    """stable (v2) and fallback (v1) were published from two commits of step 2; the archive
    holds v1's. v2's commit rots: the restore falls back to v1's commit from the archive
    (the chain reads every tier of the step), not to "no checkpoint is 'm@stable'"."""
    root, store = make(tmp_path, steps=(1, 2))
    archive = open_store(str(tmp_path / "archive"))
    registry = Registry(store)
    promote(store, registry, PromotionRequest("m", ("r", 2), stage="stable"))
    assert lifecycle.archive(store, archive, "r", 2).ok
    damage(root, 2)
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": model_at(0)}).step == 1
        ck.save(2, {"model": model_at(2)}, metadata={"val_loss": 0.1})  # another commit of step 2
    promote(store, registry, PromotionRequest("m", ("r", 2), stage="stable"))
    assert registry.aliases("m") == {"latest": 2, "stable": 2, "fallback": 1}
    damage(root, 2)
    live = {"model": model_at(0)}
    with Checkpointer(root, "r", tiers=[archive.root]) as ck:
        result = ck.restore(live, select=Alias("m", "stable"))
    assert (result.step, result.tier, result.digest) == (2, archive.url, registry.get("m", 1).manifest_digest)
    assert [s for s, _ in result.skipped] == [2] and live["model"].weight[0, 0].item() == 2
