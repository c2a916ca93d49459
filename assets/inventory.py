"""Unpartitioned views over every checkpoint: the inventory and the retention dry run.

Both are snapshots of the store (plus lifecycle records and the registry), refreshed on
a cron tick rather than ``eager()``: with partitioned parents, eager would wait for
*every* partition of evaluation/archival to exist, and a corrupt checkpoint's never
do, so the inventory would stop updating exactly when it matters.
"""

import pandas as pd
from dagster import AutomationCondition, MetadataValue, Output, asset

from assets.checkpoints import archived, checkpoint, compressed, evaluation
from assets.metadata import ratio, rounded
from assets.pricing import tier_cost_metadata
from ckptflow import lifecycle
from ckptflow.catalog.ledger import expired
from ckptflow.policy.retention import RetentionPlan
from ckptflow.reports import costs, inventory, stats
from ckptflow.reports.recoverable import short_problem
from ckptflow.reports.units import human_bytes
from ckptflow.store import Store
from resources import (
    ArchiveTierResource,
    CheckpointStoreResource,
    PricingResource,
    RegistryResource,
    RetentionResource,
)

GROUP = "inventory"
REFRESH = (AutomationCondition.cron_tick_passed("*/10 * * * *") & ~AutomationCondition.in_progress()).with_label(
    "every 10 minutes"
)


def compute_plan(
    retention: RetentionResource, hot: Store, archive: Store, registry: RegistryResource
) -> tuple[list[inventory.Entry], RetentionPlan]:
    return lifecycle.current_plan(
        hot, archive, registry.open(), retention.policy(), hot_days=retention.hot_days, pinned=retention.refs()
    )


def markdown(df: pd.DataFrame, limit: int = 200) -> MetadataValue:
    text = df.head(limit).to_markdown(index=False) if len(df) else "(empty)"
    if len(df) > limit:
        text += f"\n\n… {len(df) - limit} more rows"
    return MetadataValue.md(text)


def _cut(text, width: int) -> str:
    text = "" if text is None or (isinstance(text, float) and pd.isna(text)) else str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _problem(text) -> str:
    """A validation problem for a table cell: chunk URLs shortened to their digest's start."""
    return short_problem(str(text or ""), 60)


def _num(value) -> str:
    return "" if value is None or pd.isna(value) else f"{rounded(float(value))}"


def inventory_view(df: pd.DataFrame) -> pd.DataFrame:
    """The inventory as an operator reads it in the metadata pop-up: sizes in human
    units, metrics rounded, long texts cut (the full values are in the asset's value)."""
    metrics = [c for c in df.columns if c.startswith("metric.")]
    rows = []
    for r in df.to_dict("records"):
        rows.append(
            {
                "run": r["run"],
                "step": r["step"],
                "kind": r["kind"],
                "tiers": r["tiers"],
                "stored": human_bytes(r["stored_bytes"]),
                "ratio": _num(r["compression_ratio"]),
                "validation": r["validation"] + (f": {_problem(r['problem'])}" if r["problem"] else ""),
                **{c.removeprefix("metric."): _num(r[c]) for c in metrics},
                "last failure": _cut(r["last_failure"], 50),
                "retention": _cut(r.get("retention"), 60),
            }
        )
    return pd.DataFrame(rows)


@asset(
    group_name=GROUP,
    deps=[checkpoint, evaluation, compressed, archived],
    automation_condition=REFRESH,
    kinds={"pandas"},
)
def checkpoint_inventory(
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    registry: RegistryResource,
    pricing: PricingResource,
    retention: RetentionResource,
) -> Output[pd.DataFrame]:
    """Every checkpoint: run, step, kind, tiers, bytes, validation status, metrics, the
    last recorded failure and the retention verdict (of the ``retention`` resource's policy,
    the one ``retention_job`` applies). Also bytes and monthly cost per
    tier, priced by the ``pricing`` resource as ``storage_cost`` is (its breakdown has the savings)."""
    hot, arc = store.open(), archive.open()
    entries, plan = compute_plan(retention, hot, arc, registry)
    df = pd.DataFrame(inventory.rows(entries, plan))
    hot_stats, arc_stats = stats.store_stats(hot), stats.store_stats(arc)
    priced = costs.price({"hot": hot_stats, "archive": arc_stats}, expired(hot), pricing.model(archive))
    counts = df["validation"].value_counts().to_dict() if len(df) else {}
    return Output(
        df,
        metadata={
            "checkpoints": len(df),
            "validation_passed": counts.get("passed", 0),
            "validation_failed": counts.get("failed", 0),
            "manifest_unreadable": counts.get("unreadable", 0),
            **tier_cost_metadata(priced),
            "hot_dedup_ratio": ratio(hot_stats.dedup_ratio),
            "hot_compression_ratio": ratio(hot_stats.compression_ratio),
            "to_delete": len(plan.delete),
            "recover_to": markdown(pd.DataFrame(inventory.recovery_choices(hot, entries)).fillna("-")),
            "table": markdown(inventory_view(df)),
        },
    )


@asset(group_name=GROUP, deps=[checkpoint, evaluation, archived], automation_condition=REFRESH, kinds={"pandas"})
def retention_plan(
    retention: RetentionResource,
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    registry: RegistryResource,
) -> Output[pd.DataFrame]:
    """Dry run of the retention policy: what would be deleted and why, what is kept and
    by which rules, and per tier what happens to each copy (retention expires hot
    copies only; an archived checkpoint keeps its archive copy). The retention job
    recomputes the plan when it runs, so this view can never make it delete something
    newly pinned or aliased."""
    entries, plan = compute_plan(retention, store.open(), archive.open(), registry)
    df = pd.DataFrame(inventory.plan_rows(entries, plan))
    return Output(
        df,
        metadata={
            "keep": len(plan.keep),
            "delete": len(plan.delete),
            "archive_only": len(plan.archive_only),
            "plan": markdown(df),
        },
    )
