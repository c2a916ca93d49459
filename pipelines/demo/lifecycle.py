"""The demo's second half: drive the Dagster lifecycle over the demo store and summarise.

Uses a real on-disk ``DagsterInstance`` (the same DAGSTER_HOME `make ui` uses, with
``pipelines/instance/local.yaml`` as its dagster.yaml), so after the demo the UI shows
the partitions, the failed partition and integrity check of the corrupt checkpoint,
evaluation metrics plotted over steps, the archive copies, the deployed model with its
lineage, and the inventory, retention plan and recovery metrics as the demo computed
them. The demo's own checkpoints are driven in-process (fast); then the real daemon
carries another training process's checkpoints through (``pipelines/demo/daemon.py``).
"""

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from typing import cast

import pandas as pd
from dagster import AssetSelection, DagsterInstance, FloatMetadataValue, materialize

from assets import ALL_ASSETS, ALL_CHECKS, RPO_FRESHNESS_KEY
from ckptflow.interop.registry import Registry, describe
from ckptflow.policy.retention import DAY
from ckptflow.reports import inventory
from ckptflow.reports.stats import store_stats
from ckptflow.reports.units import human_bytes, human_duration
from ckptflow.store import open_store
from pipelines.definitions import build_definitions
from pipelines.demo import daemon as real_daemon
from pipelines.demo.text import wrapped
from pipelines.inprocess import QUIET, Driver

LOCAL_INSTANCE = os.path.join(real_daemon.REPO, "pipelines", "instance", "local.yaml")
VIEWS = ["checkpoint_inventory", "retention_plan", "recovery_metrics", "recoverability", "storage_cost"]


def _num(value, digits: int = 4) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.{digits}f}"


def _mb(n: int) -> str:
    return human_bytes(n)  # MiB, as the CLI and the UI say


def run_lifecycle(store: str, archive: str, dagster_home: str, *, fresh: bool, daemon: bool = True) -> int:
    with _quiet_logs():
        return _drive(store, archive, dagster_home, fresh=fresh, daemon=daemon)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Run logs live in the instance (the UI) and sensors log through their own handlers, so
    the demo prints only its tables; logging is as it was after, for a caller in the same
    process (the tests run the demo in theirs)."""
    names = ("dagster", "dagster.automation_condition_tester")
    levels = {name: logging.getLogger(name).level for name in names}
    disabled = logging.root.manager.disable
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(disabled)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _drive(store: str, archive: str, dagster_home: str, *, fresh: bool, daemon: bool) -> int:
    if fresh:
        shutil.rmtree(dagster_home, ignore_errors=True)
        shutil.rmtree(archive, ignore_errors=True)
    os.makedirs(dagster_home, exist_ok=True)
    if not os.path.exists(os.path.join(dagster_home, "dagster.yaml")):
        shutil.copy(LOCAL_INSTANCE, os.path.join(dagster_home, "dagster.yaml"))
    defs = build_definitions("local", store=store, archive=archive)
    print(
        f"== Dagster lifecycle in-process (DAGSTER_HOME={dagster_home}): landing sensor, validation, "
        "evaluation, compression, archival"
    )
    with DagsterInstance.from_config(dagster_home) as instance:
        report = Driver(defs, instance, quiet=True).drive()
        failed = [name for name, ok in report.runs.items() if not ok]
        print(
            f"  landed {len(report.landed)} checkpoint partitions; {len(report.runs)} runs, {len(failed)} failed: {failed}"
        )
        promoted = defs.resolve_job_def("promotion").execute_in_process(
            instance=instance,
            run_config={**QUIET, "ops": {"deployed_model": {"config": {"stage": "stable"}}}},
            raise_on_error=False,
        )
    carried = real_daemon.demonstrate(store, archive, dagster_home) if daemon else True
    with DagsterInstance.from_config(dagster_home) as instance:
        # what `make ui` shows at once: the views and the RPO check as of now, in the same instance
        inv = materialize(
            [*ALL_ASSETS, *ALL_CHECKS],  # those of ``defs`` but the MLflow mirror, which no view depends on
            selection=AssetSelection.assets(*VIEWS) | AssetSelection.checks(RPO_FRESHNESS_KEY),
            instance=instance,
            resources=dict(defs.resources or {}),
            raise_on_error=False,
            run_config=QUIET,
        )
    if not inv.success:
        print("  inventory failed; see the run in the UI")
        return 1
    df = inv.output_for_node("checkpoint_inventory")
    print(
        f"  {'run':<14} {'step':>5} {'kind':<11} {'validation':<10} {'tiers':<12} {'train_loss':>10} {'val_loss':>10} {'ratio':>6}  retention   (* overfitting: val loss up, train loss down)"
    )
    for r in df.to_dict("records"):
        print(
            f"  {r['run']:<14} {r['step']:>5} {r['kind']:<11} {r['validation']:<10} {r['tiers']:<12} {_num(r.get('metric.train_loss')):>10} "
            f"{_num(r.get('metric.val_loss')) + ('*' if r.get('overfitting') is True else ' '):>10} "
            f"{_num(r.get('compression_ratio'), 2):>6}  {r['retention']}"
        )
    for row in df[df.validation == "failed"].itertuples(index=False):
        why = f"{row.run} step {row.step} blocked by the integrity check: {row.problem}"
        print(wrapped(why, indent="  "))
    hot, arc = store_stats(open_store(store)), store_stats(open_store(archive))
    print(
        f"== bytes per tier: hot {_mb(hot.stored_bytes)} stored for {_mb(hot.logical_bytes)} logical "
        f"(dedup x{hot.dedup_ratio or 1:.1f}, compression x{hot.compression_ratio or 1:.2f}); "
        f"archive {_mb(arc.stored_bytes)} for {arc.checkpoints} checkpoints"
    )
    ops = inv.asset_materializations_for_node("recovery_metrics")[0].metadata

    def figure(name: str) -> str:  # a duration, or "-" while it has no data (left out of the metadata)
        value = ops.get(name)
        return human_duration(value.value if isinstance(value, FloatMetadataValue) else None)

    print(
        f"== recovery: RPO {figure('rpo_s')} (longest gap between recovery-ready checkpoints, last day), "
        f"commit -> recovery-ready {figure('ready_s')}, RTO {figure('rto_median_s')} median / "
        f"{figure('rto_worst_s')} worst (restore time; add your scheduler's detection time), "
        f"{ops['recoveries'].value} recoveries, success rate {ops['recovery_success_rate'].value:.0%}"
    )
    [rpo] = [c for c in inv.get_asset_check_evaluations() if c.check_name == RPO_FRESHNESS_KEY.name]
    print(
        f"   RPO freshness check: {'passed' if rpo.passed else 'WARNS'}: newest recovery-ready checkpoint "
        f"{rpo.metadata['age'].value if 'age' in rpo.metadata else 'none'} old, target {rpo.metadata['rpo_target'].value}"
    )
    deletes = [r for r in df.itertuples(index=False) if str(r.retention).startswith("delete")]
    print(
        f"== retention plan (dry run, the retention resource's policy): keep {len(df) - len(deletes)}, delete {len(deletes)}"
    )
    registry = Registry(open_store(store))
    later = inventory.retention_plan(
        inventory.collect(open_store(store)),
        time.time() + 40 * DAY,
        pinned=registry.pinned(),
        aliased=registry.aliased(),
    )
    print(
        f"   the same checkpoints 40 days from now: keep {len(later.keep)} "
        f"({', '.join(f'{s}: {why[0]}' for (_, s), why in later.keep.items())}), delete {len(later.delete)}"
    )
    if promoted.success:
        for model in registry.models():
            for alias, version in sorted(registry.aliases(model).items()):
                d = describe(registry.get(model, version))
                print(
                    f"== model {model}:{alias} -> v{version} from {d['partition_key']} (manifest {d['manifest_digest'][:12]}…)"
                )
        [promotion] = [m.metadata for m in promoted.asset_materializations_for_node("deployed_model")]
        passed_over: list[dict] = cast(list, promotion["passed_over"].value)  # by metric: the hot ones not candidates
        for row in passed_over:
            print(wrapped(f"promotion passed over {row['run']} step {row['step']}: {row['why']}", indent="   "))
        if (more := cast(int, promotion["passed_over_count"].value) - len(passed_over)) > 0:
            print(f"   … and {more} more (the metadata names the first {len(passed_over)})")
    else:
        print("== promotion failed; see the run in the UI")
    print(
        f"== see it in the UI: DAGSTER_HOME={dagster_home} CKPTFLOW_STORE={store} CKPTFLOW_ARCHIVE={archive} "
        ".venv/bin/dagster dev -w workspace.yaml   (for the default demo store: make ui)"
    )
    return 0 if promoted.success and carried else 1
