"""The demo's second half: drive the Dagster lifecycle over the demo store and summarise.

Uses a real on-disk ``DagsterInstance`` (the same DAGSTER_HOME `make ui` uses), so
after the demo the UI shows the partitions, the failed integrity check of the corrupt
checkpoint, evaluation metrics plotted over steps, the archive copies and the
deployed model with its lineage.
"""

import logging
import os
import shutil
import time

import pandas as pd
from dagster import DagsterInstance, materialize

from ckptflow import inventory
from ckptflow.registry import Registry, describe
from ckptflow.retention import DAY
from ckptflow.stats import store_stats
from ckptflow.store import open_store
from pipelines.definitions import build_definitions
from pipelines.inprocess import QUIET, Driver


def _num(value, digits: int = 4) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.{digits}f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def run_lifecycle(store: str, archive: str, dagster_home: str, fresh: bool) -> int:
    if fresh:
        shutil.rmtree(dagster_home, ignore_errors=True)
        shutil.rmtree(archive, ignore_errors=True)
    os.makedirs(dagster_home, exist_ok=True)
    for name in ("dagster", "dagster.automation_condition_tester"):  # run logs live in the instance (the UI)
        logging.getLogger(name).setLevel(logging.CRITICAL)
    defs = build_definitions("local", store=store, archive=archive)
    print(
        f"== Dagster lifecycle in-process (DAGSTER_HOME={dagster_home}): landing sensor, validation, "
        "evaluation, compression, archival"
    )
    with DagsterInstance.local_temp(dagster_home) as instance:
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
        inv = materialize(
            [*defs.assets],
            selection=["checkpoint_inventory"],
            instance=instance,
            resources=dict(defs.resources),
            raise_on_error=False,
            run_config=QUIET,
        )
    if not inv.success:
        print("  inventory failed; see the run in the UI")
        return 1
    df = inv.output_for_node("checkpoint_inventory")
    print(
        f"  {'step':>5} {'kind':<11} {'validation':<10} {'tiers':<12} {'train_loss':>10} {'val_loss':>10} {'ratio':>6}  retention   (* overfitting: val loss up, train loss down)"
    )
    for r in df.to_dict("records"):
        print(
            f"  {r['step']:>5} {r['kind']:<11} {r['validation']:<10} {r['tiers']:<12} {_num(r.get('metric.train_loss')):>10} "
            f"{_num(r.get('metric.val_loss')) + ('*' if r.get('overfitting') is True else ' '):>10} "
            f"{_num(r.get('compression_ratio'), 2):>6}  {r['retention'][:90]}"
        )
    for row in df[df.validation == "failed"].itertuples(index=False):
        print(f"  step {row.step} blocked by the integrity check: {row.problem[:110]}…")
    hot, arc = store_stats(open_store(store)), store_stats(open_store(archive))
    print(
        f"== bytes per tier: hot {_mb(hot.stored_bytes)} stored for {_mb(hot.logical_bytes)} logical "
        f"(dedup x{hot.dedup_ratio or 1:.1f}, compression x{hot.compression_ratio or 1:.2f}); "
        f"archive {_mb(arc.stored_bytes)} for {arc.checkpoints} checkpoints"
    )
    deletes = [r for r in df.itertuples(index=False) if str(r.retention).startswith("delete")]
    print(f"== retention plan (dry run, default policy): keep {len(df) - len(deletes)}, delete {len(deletes)}")
    registry = Registry(open_store(store))
    later = inventory.retention_plan(
        inventory.collect(open_store(store)), time.time() + 40 * DAY, registry.pinned(), registry.aliased()
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
    else:
        print("== promotion failed; see the run in the UI")
    print(
        f"== see it in the UI: DAGSTER_HOME={dagster_home} CKPTFLOW_STORE={store} CKPTFLOW_ARCHIVE={archive} "
        ".venv/bin/dagster dev -w workspace.yaml   (for the default demo store: make ui)"
    )
    return 0 if promoted.success else 1
