"""A promotion by metric says in its materialization which hot checkpoints it passed over."""

import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.lifecycle.promote import SHOWN
from ckptflow.store import open_store
from support.dagster import RUN

RANKED_ON = "not on team.eval's figures, which the others are ranked on"
NO_SCORE = "no score of 'val_loss' (evaluated, or reported by its trainer)"


def test_a_promotion_by_metric_names_the_checkpoints_it_passed_over(store_with_checkpoints, defs, instance):
    """Steps 10 and 20 of the TinyLM run evaluated by team.eval, run "other" scored by its
    trainer only (a better figure, on another scale): the promotion ranked on team.eval's
    figures and its materialization said nothing of run "other", nor of steps 30 and 40
    (no score). Now ``passed_over`` names each, with why."""
    store = open_store(store_with_checkpoints)
    torch.manual_seed(0)
    with Checkpointer(store, "other") as ck:
        ck.save(1, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 0.01})
    for run, step in ((RUN, 10), (RUN, 20), ("other", 1)):
        assert lifecycle.validate(store, run, step)["ok"]
    for step, loss in ((10, 3.0), (20, 2.0)):
        lifecycle.evaluate(
            store, store, RUN, step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name="team.eval"
        )
    run_config = {"ops": {"deployed_model": {"config": {"action": "promote", "metric": "val_loss"}}}}
    result = defs.resolve_job_def("promotion").execute_in_process(instance=instance, run_config=run_config)
    [md] = [m.metadata for m in result.asset_materializations_for_node("deployed_model")]
    assert md["source_partition"].value.endswith("@20")
    assert md["passed_over"].value == [
        {"run": "other", "step": 1, "why": f"scored on the trainer's figures only, {RANKED_ON}"},
        {"run": RUN, "step": 30, "why": "no score of 'val_loss' (evaluated, or reported by its trainer)"},
        {"run": RUN, "step": 40, "why": "no score of 'val_loss' (evaluated, or reported by its trainer)"},
    ]
    logged = [e.message for e in instance.all_logs(result.run_id) if "passed over" in (e.message or "")]
    assert len(logged) == 1 and f"run 'other' step 1: scored on the trainer's figures only, {RANKED_ON}" in logged[0]


def test_a_promotion_by_metric_ranks_on_the_scale_the_archive_only_commits_choose(
    store_with_checkpoints, paths, defs, instance
):
    """Steps 10 and 20 evaluated by team.eval, archived, their hot copies expired; step 30
    evaluated by other.eval (a better figure), step 40 by team.eval. A ``Best`` restore
    reading the archive ranks on team.eval's figures and takes step 40; the promotion read
    the hot store alone (one commit per evaluator: the tie to other.eval) and deployed 30."""
    store, archive = open_store(store_with_checkpoints), open_store(paths["archive"])
    for step, name, loss in ((10, "team", 3.0), (20, "team", 2.5), (30, "other", 0.1), (40, "team", 2.0)):
        assert lifecycle.validate(store, RUN, step)["ok"]
        lifecycle.evaluate(
            store, store, RUN, step, lambda t, i, loss=loss: {"val_loss": loss}, evaluator_name=f"{name}.eval"
        )
    for step in (10, 20):
        assert lifecycle.archive(store, archive, RUN, step).ok
        lifecycle.expire(store, RUN, step, keep_records=True)
    run_config = {"ops": {"deployed_model": {"config": {"action": "promote", "metric": "val_loss"}}}}
    result = defs.resolve_job_def("promotion").execute_in_process(instance=instance, run_config=run_config)
    [md] = [m.metadata for m in result.asset_materializations_for_node("deployed_model")]
    assert md["source_partition"].value.endswith("@40")
    assert [(row["step"], row["why"]) for row in md["passed_over"].value] == [
        (30, f"scored on other.eval's figures only, {RANKED_ON}")
    ]


def test_a_promotion_names_the_first_checkpoints_it_passed_over_and_counts_them_all(
    store_with_checkpoints, defs, instance
):
    """Run "other" holds 120 checkpoints with no score: the materialization's metadata
    listed every one (each checkpoint of a backlog, into the event log and the UI)."""
    store = open_store(store_with_checkpoints)
    torch.manual_seed(0)
    with Checkpointer(store, "other") as ck:
        for step in range(1, 121):
            ck.save(step, {"model": nn.Linear(4, 4)})
    assert lifecycle.validate(store, RUN, 20)["ok"]
    lifecycle.evaluate(store, store, RUN, 20, lambda t, i: {"val_loss": 2.0}, evaluator_name="team.eval")
    run_config = {"ops": {"deployed_model": {"config": {"action": "promote", "metric": "val_loss"}}}}
    result = defs.resolve_job_def("promotion").execute_in_process(instance=instance, run_config=run_config)
    [md] = [m.metadata for m in result.asset_materializations_for_node("deployed_model")]
    assert md["source_partition"].value.endswith("@20") and md["passed_over_count"].value == 123
    rows = md["passed_over"].value
    assert len(rows) == SHOWN and rows[0] == {"run": "other", "step": 1, "why": NO_SCORE}
    logged = [e.message for e in instance.all_logs(result.run_id) if "passed over" in (e.message or "")]
    assert len(logged) == 1 and logged[0].count(NO_SCORE) == SHOWN and f"… {123 - SHOWN} more" in logged[0]
