"""``checkpoint_advice`` (per run: current vs optimal interval, a cost plot) and its WARN check."""

import re

from dagster import AssetCheckKey, AssetCheckSeverity, AssetMaterialization, AssetSelection, materialize

from ckptflow import Checkpointer, SavePolicy
from support.states import tiny_state, tiny_train


def _train(root: str, run: str, steps: int) -> None:
    state = tiny_state()
    with Checkpointer(root, run) as ckpt:
        for step in range(steps):
            tiny_train(state)
            ckpt.save(step, state)  # every step: far more often than the optimum for a day's MTBF


def test_the_advice_per_run_and_a_warning_when_a_run_is_far_off_its_optimum(paths, resources, instance):
    from assets import checkpoint_advice

    _train(paths["store"], "often", 4)
    _train(paths["store"], "once", 1)  # one commit: no current interval to judge
    result = materialize([checkpoint_advice], instance=instance, resources=resources)
    df = result.output_for_node("checkpoint_advice").set_index("run")
    assert df.loc["often", "current_steps"] == 1 and df.loc["often", "optimal_steps"] > 2
    assert df.loc["often", "ratio"] < 0.5 and "too little history" in df.loc["often", "notes"]
    metadata = result.asset_materializations_for_node("checkpoint_advice")[0].metadata
    plot = metadata["often/plot"].value
    assert "<- current" in plot and "<- optimal" in plot and "once/plot" in metadata

    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and evaluation.severity == AssetCheckSeverity.WARN
    runs_off = evaluation.metadata["runs_off"].value
    assert "often: every 1 steps" in runs_off and "once" not in runs_off


def test_a_run_whose_current_interval_costs_least_is_not_warned_about(paths, resources, instance, monkeypatch):
    """The current interval runs its own full/incremental mix and may sit between the
    optimum's whole steps, so it can cost less than the optimum found at a ratio past
    ``MAX_RATIO``: the check warned "far off its optimum" about the cheapest interval."""
    import assets.advice
    from assets import checkpoint_advice
    from ckptflow.policy import interval as model
    from ckptflow.reports.advice import Advice

    _train(paths["store"], "often", 4)
    inputs = model.IntervalInputs(save_s=1.0, save_duration_s=1.0, restore_s=10.0, mtbf_s=86400.0, step_time_s=1.0)
    cheapest = model.optimum(inputs)
    advice = Advice(
        run="often", inputs=inputs, optimal=model.evaluate(inputs, 4 * cheapest.interval_s), current=cheapest,
        young_s=model.young(1.0, 86400.0), full_every=1, current_full_every=1,
    )  # fmt: skip
    assert advice.keep_current and cheapest.interval_s / advice.optimal.interval_s < 1 / assets.advice.MAX_RATIO
    monkeypatch.setattr(assets.advice, "advise", lambda *args, **kwargs: advice)
    result = materialize([checkpoint_advice], instance=instance, resources=resources)
    assert result.output_for_node("checkpoint_advice").set_index("run").loc["often", "keep_current"]
    evaluation = _interval_check(instance, resources)
    assert evaluation.passed and evaluation.metadata["runs_off"].value == "none"


def test_a_current_interval_of_two_and_a_half_steps_is_said_as_such(paths, resources, instance):
    """Saves every 2 and 3 steps in turn: the table and the check's message said "every 2
    steps" (or 3: float seconds divided back by the step time, rounded)."""
    from assets import checkpoint_advice

    state = tiny_state()
    with Checkpointer(paths["store"], "halves") as ckpt:
        for step in range(21):
            tiny_train(state)
            if step % 5 in (0, 2):
                ckpt.save(step, state)
    result = materialize([checkpoint_advice], instance=instance, resources=resources)
    row = result.output_for_node("checkpoint_advice").set_index("run").loc["halves"]
    assert row["current_steps"] == 2.5 and row["ratio"] < 0.5  # a day's MTBF: far more often than optimal
    runs_off = _interval_check(instance, resources).metadata["runs_off"].value
    assert f"halves: every 2.5 steps; optimum {round(row['optimal_steps'])} (" in runs_off, runs_off


def test_the_plot_marks_the_current_and_optimal_costs_of_the_table(paths, resources, instance):
    """The plot priced every interval at the optimum's full/incremental mix, the current one
    too, while the table prices the current interval at the run's own mix: with a full every
    4 saves against the advised full every time, the marked "current" cost was not the
    table's."""
    from assets import checkpoint_advice

    state = tiny_state()
    with Checkpointer(paths["store"], "mixed", policy=SavePolicy(full_every=4, incremental_every=1)) as ckpt:
        for step in range(13):
            tiny_train(state)
            ckpt.save(step, state)
    result = materialize([checkpoint_advice], instance=instance, resources=resources)
    row = result.output_for_node("checkpoint_advice").set_index("run").loc["mixed"]
    plot = result.asset_materializations_for_node("checkpoint_advice")[0].metadata["mixed/plot"].value
    marked = {m["name"]: m["usd"] for m in re.finditer(r" (?P<usd>[\d,]+\.\d\d) <- (?P<name>\w+)", plot)}
    assert marked == {"current": f"{row['current_usd_month']:,.2f}", "optimal": f"{row['optimal_usd_month']:,.2f}"}
    assert "<- current (its own mix: a full every 4)" in plot, plot


def test_the_check_judges_by_the_config_the_asset_was_materialized_with(paths, resources, instance):
    """The check advised again with the defaults (a day's MTBF): under an operator's MTBF for
    which the asset finds the run's every-step saves about optimal, it still warned."""
    from assets import checkpoint_advice

    _train(paths["store"], "often", 4)
    config = {"ops": {"checkpoint_advice": {"config": {"mtbf_s": 1e-4, "gpus": 8, "gpu_hour_usd": 3.0}}}}
    result = materialize([checkpoint_advice], instance=instance, resources=resources, run_config=config)
    row = result.output_for_node("checkpoint_advice").set_index("run").loc["often"]
    assert row["mtbf_s"] == 1e-4 and 0.5 <= row["ratio"] <= 2  # about optimal under this config
    evaluation = _interval_check(instance, resources)
    assert evaluation.passed and evaluation.metadata["runs_off"].value == "none"
    materialize([checkpoint_advice], instance=instance, resources=resources)  # the defaults: far off
    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and "often: every 1 steps" in evaluation.metadata["runs_off"].value


def _interval_check(instance, resources):
    """The evaluation of the ``interval_near_optimum`` check, run on its own."""
    from assets import checkpoint_advice, interval_near_optimum

    check = materialize(
        [checkpoint_advice, interval_near_optimum],
        selection=AssetSelection.checks(AssetCheckKey(checkpoint_advice.key, "interval_near_optimum")),
        instance=instance,
        resources=resources,
    )
    [evaluation] = check.get_asset_check_evaluations()
    return evaluation


def test_a_config_advise_cannot_use_fails_the_asset_not_each_run(paths, resources, instance):
    """scenario "spot" was ``advise``'s error for every run, each skipped as if it had too
    little history: the asset succeeded with an empty table, and its check passed."""
    import pytest

    from assets import checkpoint_advice
    from ckptflow.errors import CkptflowError

    _train(paths["store"], "often", 4)
    for bad in ({"scenario": "spot"}, {"mtbf_s": 0.0}):
        config = {"ops": {"checkpoint_advice": {"config": bad}}}
        with pytest.raises(CkptflowError, match="unknown scenario 'spot'|MTBF must be a positive duration"):
            materialize([checkpoint_advice], instance=instance, resources=resources, run_config=config)


def test_the_check_run_before_the_asset_was_ever_materialized_says_to_materialize_it(paths, resources, instance):
    """Run alone on a fresh instance, the check failed with Dagster's own FileNotFoundError
    (loading a DataFrame the IO manager never stored). With nothing to judge it fails (WARN, as
    it does for a run off its optimum: a check that cannot judge does not pass) and says what
    to do; once the advice is materialized it judges it."""
    _train(paths["store"], "often", 4)
    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and evaluation.severity == AssetCheckSeverity.WARN
    assert evaluation.description is not None
    assert "checkpoint_advice has not been materialized on this instance" in evaluation.description
    assert "materialize checkpoint_advice first" in evaluation.description
    assert evaluation.metadata["runs_off"].value == "not judged"

    from assets import checkpoint_advice

    instance.report_runless_asset_event(AssetMaterialization(checkpoint_advice.key))  # an earlier ckptflow's
    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and evaluation.description is not None
    assert "materialized by an earlier ckptflow" in evaluation.description
    materialize([checkpoint_advice], instance=instance, resources=resources)
    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and "often: every 1 steps" in evaluation.metadata["runs_off"].value


def test_intervals_the_check_cannot_read_are_named_not_a_crash(paths, resources, instance):
    """A materialization whose ``intervals`` hold entries of another shape (reported by hand, or
    by a ckptflow that writes them otherwise) crashed the check: KeyError 'keep_current', a
    string ratio compared with a number (TypeError), 'str' object has no attribute 'get'. Such
    entries are not judged: the check fails (WARN), names them and says to materialize again;
    the entries it can read are still judged."""
    from dagster import MetadataValue

    from assets import checkpoint_advice

    judged = {"ratio": 0.1, "keep_current": False, "current_steps": 1, "optimal_steps": 10}
    intervals = {
        "off": judged,
        "no-keep": {"ratio": 3.0, "current_steps": 3, "optimal_steps": 1},
        "text-ratio": {**judged, "ratio": "0.1"},
        "not-a-row": "every 2 steps",
        "bool-ratio": {**judged, "ratio": True},
    }
    event = AssetMaterialization(checkpoint_advice.key, metadata={"intervals": MetadataValue.json(intervals)})
    instance.report_runless_asset_event(event)
    evaluation = _interval_check(instance, resources)
    assert not evaluation.passed and evaluation.severity == AssetCheckSeverity.WARN
    runs_off = evaluation.metadata["runs_off"].value
    assert "off: every 1 steps; optimum 10 (0.1x)" in runs_off
    for run in ("no-keep", "text-ratio", "not-a-row", "bool-ratio"):
        assert f"{run}: not judged" in runs_off, runs_off
    assert evaluation.description is not None and "materialize checkpoint_advice again" in evaluation.description


def test_each_runs_current_interval_says_where_it_was_read(paths, resources, instance):
    """A run saved by ``SavePolicy.adaptive`` is read at its newest save's decision, another
    by the gaps between its commits (``ckptflow advise`` says which in its sources); the
    asset's rows showed the figure alone, so an operator could not tell a decision from a
    median of gaps."""
    from assets import checkpoint_advice

    _train(paths["store"], "fixed", 4)
    state = tiny_state()
    policy = SavePolicy.adaptive(initial_every=2, min_every=2, max_every=2)
    with Checkpointer(paths["store"], "adaptive", policy=policy) as ckpt:
        for step in range(7):
            tiny_train(state)
            ckpt.save(step, state)
    result = materialize([checkpoint_advice], instance=instance, resources=resources)
    df = result.output_for_node("checkpoint_advice").set_index("run")
    assert df.loc["adaptive", "current_steps"] == 2 and "save_decision" in df.loc["adaptive", "current_from"]
    assert df.loc["fixed", "current_steps"] == 1 and "gap" in df.loc["fixed", "current_from"]
