"""The in-process driver's report (``pipelines.inprocess``): what the demo's "landed N
checkpoint partitions; M runs" line counts."""

import torch

from assets import checkpoint_key
from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from pipelines import demo
from pipelines.inprocess import QUIET, Driver, DriveReport, dynamic_keys, tick_landing
from support.corrupt import corrupt_chunk, only_in
from support.dagster import RUN, write_checkpoints


def test_a_step_committed_again_lands_in_its_partition_once_and_both_validations_are_runs(
    store_with_checkpoints, defs, instance
):
    """Restore rejects step 40, training falls back to 30 and commits step 40 again, while the
    driver runs. ``landed`` counted validation run requests: the second commit made it 5
    "checkpoint partitions" for 4 partitions, and the second validation run replaced the
    first one's entry in ``runs``. Each partition lands once; each run is its own entry."""
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    report = DriveReport()
    cursor, _ = tick_landing(defs, instance, None, report, QUIET)
    assert report.landed == keys and report.runs == {f"validate_checkpoint[{k}]": True for k in keys}

    corrupt_chunk(store_with_checkpoints, RUN, 40, only_in(store_with_checkpoints, RUN, 40, 30)[0])
    torch.manual_seed(1)
    state = demo.build()
    with Checkpointer(store_with_checkpoints, RUN) as ck:
        assert ck.restore(state).step == 30
        ck.save(40, state, metadata={"train_loss": 0.5})  # a second commit of step 40
    again = catalog.read_manifest(open_store(store_with_checkpoints), RUN, 40).digest
    tick_landing(defs, instance, cursor, report, QUIET)

    assert report.landed == keys  # the partitions commits landed in, each once
    assert report.runs == {
        **{f"validate_checkpoint[{k}]": True for k in keys},
        f"validate_checkpoint[{keys[3]}@{again[:16]}]": True,  # the second commit's own validation
    }


def _toy_defs(resources):
    """The landing machinery, plus assets whose automation runs ``s`` again three rounds on:
    ``s`` and ``d`` run in round 1 (``x`` changed), ``f`` and ``t`` in round 2, ``e`` after
    them; round 3 runs ``s`` again (``e`` changed) and nothing else, and round 4 ``t`` again.
    (An asset that ran in a round is not run in the next: Dagster counts it handled.)"""
    from dagster import (
        AssetSelection,
        AutomationCondition,
        AutomationConditionSensorDefinition,
        Definitions,
        StaticPartitionsDefinition,
        asset,
    )

    from assets import ALL_CHECKS, checkpoint
    from sensors.failures import failure_sensor
    from sensors.landing import landing_sensor, validation_job

    one = StaticPartitionsDefinition(["p"])
    eager = AutomationCondition.eager()

    @asset(partitions_def=one)
    def x() -> None: ...

    @asset(partitions_def=one, deps=[x], automation_condition=eager)
    def d() -> None: ...

    @asset(partitions_def=one, deps=[d], automation_condition=eager)
    def f() -> None: ...

    @asset(partitions_def=one, deps=[f], automation_condition=eager)
    def e() -> None: ...

    @asset(deps=[x, e], automation_condition=eager)
    def s() -> None: ...

    @asset(deps=[s], automation_condition=eager)
    def t() -> None: ...

    sensors = [  # evaluated in this order each round
        AutomationConditionSensorDefinition("a_sensor", target=AssetSelection.assets(f, t)),
        AutomationConditionSensorDefinition("b_sensor", target=AssetSelection.assets(s, d)),
        AutomationConditionSensorDefinition("c_sensor", target=AssetSelection.assets(e)),
    ]
    definitions = Definitions(
        assets=[checkpoint, x, d, f, e, s, t],
        asset_checks=ALL_CHECKS,
        jobs=[validation_job],
        sensors=[landing_sensor, failure_sensor, *sensors],
        resources=resources,
    )
    return definitions, {a.key.to_user_string(): a for a in (x, d, f, e, s, t)}


def test_a_round_that_only_runs_again_what_ran_before_does_not_end_the_automation(resources, instance):
    """``run_automation`` wrote a run of an asset and partition that had run earlier in the
    drive over its entry in ``runs``, so a round of such runs added nothing, ``drive`` took it
    for quiet and stopped: round 3 ran ``s`` again, and ``t``, which reads ``s``, was left
    older than it (report: s and t once each, of two runs each). Every run is an entry of its
    own, so the drive goes on until a round runs nothing."""
    from dagster import materialize

    defs, a = _toy_defs(resources)
    materialize([a["x"], a["d"], a["f"], a["e"]], partition_key="p", instance=instance)
    materialize([a["s"], a["t"]], instance=instance)
    driver = Driver(defs, instance, quiet=True)
    materialize([a["x"]], partition_key="p", instance=instance)  # the change the automation follows

    report = driver.drive()

    def newest(name: str) -> int:
        return instance.fetch_materializations(a[name].key, limit=1).records[0].storage_id

    assert newest("t") > newest("s") > newest("e")  # t ran after s's last run: nothing is left stale
    assert report.runs == {
        "s[None]": True,
        "d[p]": True,
        "f[p]": True,
        "t[None]": True,
        "e[p]": True,
        "s[None] #2": True,
        "t[None] #2": True,
    }
    assert driver.drive().runs == {}  # it was quiet


def test_a_driver_started_without_a_cursor_lands_the_commits_after_a_page_landed_before(
    store_with_checkpoints, resources, instance, monkeypatch
):
    """A tick lands at most ``MAX_PER_TICK`` commits, oldest first; the demo run again on its
    ``DAGSTER_HOME`` starts a driver without a cursor. Its first tick met only commits landed
    before (partitions held, validated for their digest): no new partition and no run, which
    ``drive`` took for quiet, so it stopped with the newer commits (step 50, 60) never landed
    while more than a page was already there (500 commits; 2 here). The drive goes on until a
    tick lands no commit record at all."""
    from ckptflow.lifecycle import landing

    monkeypatch.setattr(landing, "MAX_PER_TICK", 2)
    defs, _ = _toy_defs(resources)
    before = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    assert Driver(defs, instance, quiet=True).drive().landed == before  # two pages
    write_checkpoints(store_with_checkpoints, steps=(50, 60))

    report = Driver(defs, instance, quiet=True).drive()  # the demo again: no cursor

    newer = [checkpoint_key(RUN, s) for s in (50, 60)]
    assert report.landed == newer, report.landed
    assert report.runs == {f"validate_checkpoint[{k}]": True for k in newer}
    assert dynamic_keys(instance) == before + newer
