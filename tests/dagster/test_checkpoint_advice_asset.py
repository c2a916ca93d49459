"""``checkpoint_advice`` (per run: current vs optimal interval, a cost plot) and its WARN check."""

from dagster import AssetCheckKey, AssetCheckSeverity, AssetSelection, materialize

from ckptflow import Checkpointer
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
