"""A promotion by metric ranks every run's validated hot checkpoints on one scale; the
ones it could not rank there are passed over, and it says which and why, as a ``Best``
restore does in ``passed_over``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.selection import Best
from ckptflow.errors import PromotionError
from ckptflow.format import layout as fmt
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import SHOWN, PromotionRequest, promote
from ckptflow.store import open_store
from support.corrupt import flip_byte, manifest_path

RANKED_ON = "which the others are ranked on"


def three_runs(tmp_path):
    """Run "a": steps 1 to 3 evaluated by team.eval (2.0, 2.5, 1.0), step 3 not validated yet;
    run "b": step 1 scored by its trainer only (0.01); run "c": step 1 evaluated by
    other.eval (0.1). Every other step validated."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    for run, steps in (("a", (1, 2, 3)), ("b", (1,)), ("c", (1,))):
        with Checkpointer(root, run) as ck:
            for step in steps:
                ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.01 * step})
    store = open_store(root)
    for run, step in (("a", 1), ("a", 2), ("b", 1), ("c", 1)):
        assert lifecycle.validate(store, run, step)["ok"]
    for run, step, name, loss in (
        ("a", 1, "team", 2.0),
        ("a", 2, "team", 2.5),
        ("a", 3, "team", 1.0),
        ("c", 1, "other", 0.1),
    ):
        lifecycle.evaluate(
            store, store, run, step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name=f"{name}.eval"
        )
    return store


def test_a_promotion_by_metric_says_which_runs_it_left_out_and_why(tmp_path):
    """Ranked on team.eval's figures (it scored the most), run "b" (its trainer's 0.01) and
    run "c" (other.eval's 0.1) were left out of the promotion without a word: the result was
    the version alone, so an operator could not tell that two runs were never considered.
    Now ``passed_over`` names each with why, in the wording of a ``Best`` restore's."""
    store = three_runs(tmp_path)
    promotion = promote(store, Registry(store), PromotionRequest("m"))
    assert (promotion.registered.run, promotion.registered.step) == ("a", 1)
    assert promotion.passed_over == [
        ("a", 3, "not validated yet"),
        ("b", 1, f"scored on the trainer's figures only, not on team.eval's figures, {RANKED_ON}"),
        (
            "c",
            1,
            f"scored on other.eval's figures and the trainer's figures only, not on team.eval's figures, {RANKED_ON}",
        ),
    ]


def test_a_promotion_of_a_named_checkpoint_passes_nothing_over(tmp_path):
    store = three_runs(tmp_path)
    promotion = promote(store, Registry(store), PromotionRequest("m", ("b", 1)))
    assert (promotion.registered.run, promotion.registered.step, promotion.passed_over) == ("b", 1, [])


def test_a_promotion_counts_the_archive_only_commits_in_its_scale_as_best_does(tmp_path):
    """Steps 1 and 2 evaluated by team.eval, archived, their hot copies expired; hot step 3
    evaluated by other.eval (0.1), step 4 by team.eval (1.0). A ``Best`` restore reading the
    archive ranks on team.eval's figures (3 commits) and takes step 4; promotion counted the
    hot commits only (one each: the tie to the first by name, other.eval) and promoted step 3."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    with Checkpointer(root, "r") as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.5})
    store, archive = open_store(root), open_store(str(tmp_path / "archive"))
    for step, name, loss in ((1, "team", 2.0), (2, "team", 1.5), (3, "other", 0.1), (4, "team", 1.0)):
        assert lifecycle.validate(store, "r", step)["ok"]
        lifecycle.evaluate(
            store, store, "r", step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name=f"{name}.eval"
        )
    for step in (1, 2):
        assert lifecycle.archive(store, archive, "r", step).ok
        lifecycle.expire(store, "r", step, keep_records=True)
    with Checkpointer(root, "r", tiers=[archive]) as ck:
        best = ck.restore({"model": nn.Linear(4, 4)}, select=Best("val_loss", "min"))
    promotion = promote(store, Registry(store), PromotionRequest("m"), archive=archive)
    assert (promotion.registered.step, best.step) == (4, 4)
    assert promotion.passed_over == [
        (
            "r",
            3,
            f"scored on other.eval's figures and the trainer's figures only, not on team.eval's figures, {RANKED_ON}",
        )
    ]


def test_a_refusal_names_the_first_checkpoints_it_passed_over_and_counts_the_rest(tmp_path):
    """200 checkpoints scored by their trainer, none validated yet (a backlog): the refusal
    named every one, 200 lines in one error (a Dagster failure's description)."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    with Checkpointer(root, "r") as ck:
        for step in range(1, 201):
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 1.0 / step})
    store = open_store(root)
    with pytest.raises(PromotionError) as refused:
        promote(store, Registry(store), PromotionRequest("m"))
    message = str(refused.value)
    assert message.count(": not validated yet") == SHOWN and f"… {200 - SHOWN} more" in message
    assert "run 'r' step 1: not validated yet" in message and "step 200:" not in message
    assert not [o.key for o in store.list("") if o.key.startswith(("registry/", "locks/"))]  # nothing written


def test_promotion_counts_an_earlier_commit_only_the_archive_holds_in_its_scale_as_best_does(tmp_path):
    """Step 1 evaluated by zeta.eval (1.0); step 2's first commit A by zeta.eval (2.0),
    archived, then step 2 committed again (B) and evaluated by alpha.eval (0.1). ``Best``
    counts every commit a tier holds: zeta.eval scored two, so it ranks on zeta.eval's
    figures and takes step 1. Promotion's inventory entry of step 2 carried B's records
    only: one commit each, the tie to the first by name (alpha.eval), and it promoted B."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    store, archive = open_store(root), open_store(str(tmp_path / "archive"))

    def scored(step: int, name: str, loss: float) -> None:
        with Checkpointer(root, "r") as ck:
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.5})
        assert lifecycle.validate(store, "r", step)["ok"]
        lifecycle.evaluate(store, store, "r", step, lambda t, i: {"val_loss": loss}, evaluator_name=f"{name}.eval")

    scored(1, "zeta", 1.0)
    scored(2, "zeta", 2.0)
    assert lifecycle.archive(store, archive, "r", 2).ok
    store.delete(fmt.manifest_key("r", 2))  # as a save of the step again after a rejected restore
    scored(2, "alpha", 0.1)
    with Checkpointer(root, "r", tiers=[archive]) as ck:
        best = ck.restore({"model": nn.Linear(4, 4)}, select=Best("val_loss", "min"))
    promotion = promote(store, Registry(store), PromotionRequest("m"), archive=archive)
    assert (promotion.registered.step, best.step) == (1, 1)
    why = f"scored on alpha.eval's figures and the trainer's figures only, not on zeta.eval's figures, {RANKED_ON}"
    assert promotion.passed_over == [("r", 2, why)]


def test_promotion_counts_the_archive_copy_of_a_step_whose_hot_commit_record_rotted_as_best_does(tmp_path):
    """Step 1 evaluated by alpha.eval; steps 2 and 3 by zeta.eval, step 2 archived, then its
    hot commit record rotted. ``Best`` counts the archive's sound commit of step 2 (a tier
    holds it, its validation passed): zeta.eval scored two, so it ranks on zeta.eval's
    figures. Promotion left step 2 out of its count for its hot copy failing (the entry's
    ``valid``, not the commit's verdict): one each, the tie to alpha.eval, and it promoted
    step 1, ranked on another scale than ``Best``."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    store, archive = open_store(root), open_store(str(tmp_path / "archive"))
    for step, name, loss in ((1, "alpha", 1.0), (2, "zeta", 0.5), (3, "zeta", 2.0)):
        with Checkpointer(root, "r") as ck:
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.5})
        assert lifecycle.validate(store, "r", step)["ok"]
        lifecycle.evaluate(
            store, store, "r", step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name=f"{name}.eval"
        )
    assert lifecycle.archive(store, archive, "r", 2).ok
    flip_byte(manifest_path(root, "r", 2), offset=10)
    with Checkpointer(root, "r", tiers=[archive]) as ck:
        best = ck.restore({"model": nn.Linear(4, 4)}, select=Best("val_loss", "min"))
    assert best.step == 2 and best.tier == archive.url  # ranked on zeta.eval's figures: 0.5 is the best
    promotion = promote(store, Registry(store), PromotionRequest("m"), archive=archive)
    assert promotion.registered.step == 3  # the best hot one on zeta.eval's figures
    whys = {step: why for _, step, why in promotion.passed_over}
    assert (
        whys[1]
        == f"scored on alpha.eval's figures and the trainer's figures only, not on zeta.eval's figures, {RANKED_ON}"
    )


def test_promotion_counts_the_recorded_commits_of_a_step_whose_only_commit_record_rotted_as_best_does(tmp_path):
    """As above with no archive: step 2's only commit record rotted, so no tier's commit is
    known there. ``Best`` counts every commit recorded at that step (the tier may hold any of
    them): zeta.eval's scale, and it restores step 3. Promotion must rank on that scale too."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    store = open_store(root)
    for step, name, loss in ((1, "alpha", 1.0), (2, "zeta", 0.5), (3, "zeta", 2.0)):
        with Checkpointer(root, "r") as ck:
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.5})
        assert lifecycle.validate(store, "r", step)["ok"]
        lifecycle.evaluate(
            store, store, "r", step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name=f"{name}.eval"
        )
    flip_byte(manifest_path(root, "r", 2), offset=10)
    with Checkpointer(root, "r") as ck:
        best = ck.restore({"model": nn.Linear(4, 4)}, select=Best("val_loss", "min"))
    promotion = promote(store, Registry(store), PromotionRequest("m"))
    assert (best.step, promotion.registered.step) == (3, 3)
