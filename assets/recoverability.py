"""``recoverability``: the operator's one place for "is training recoverable right now?".

Per run: the newest recovery-ready checkpoint (step, age, tier), the RPO against its
target, the last recovery and its RTO, and how many checkpoints need attention ("1 of
6 need attention", with the reason of each); bytes and $/month per tier. The decisions
are the library's (``ckptflow.reports.recoverable``); this body reads the configuration
and writes metadata: the answer as a line, the per-run status as a ``TableMetadataValue``
(rendered as a table on the asset's page, no click), what needs attention and the tiers
as Markdown tables, and per-run numbers the UI plots over materializations. Refreshed
with the inventory, on the same cadence.

A corrupt checkpoint stays a failed partition of ``checkpoint`` (its blocking check
keeps it from being evaluated, compressed or archived); here it is counted, beside
the healthy ones, so an operator sees its weight.
"""

import pandas as pd
from dagster import MetadataValue, Output, TableColumn, TableRecord, TableSchema, asset

from assets.checkpoints import archived, checkpoint, evaluation
from assets.freshness import rpo_target_s
from assets.inventory import GROUP, REFRESH, markdown
from assets.metadata import rounded
from assets.metrics import RecoveryConfig
from assets.pricing import tier_cost_metadata
from ckptflow.catalog.gc import parse_duration
from ckptflow.reports import recoverable
from resources import ArchiveTierResource, CheckpointStoreResource, PricingResource

COLUMNS = ["run", "recoverable", "newest ready", "age", "tier", "RPO (target)", "last recovery", "RTO", "attention"]


def _table(rows: list[dict[str, str]]) -> MetadataValue:
    return MetadataValue.table(
        records=[TableRecord(data={c: r[c] for c in COLUMNS}) for r in rows],
        schema=TableSchema(columns=[TableColumn(c, "string") for c in COLUMNS]),
    )


@asset(group_name=GROUP, deps=[checkpoint, evaluation, archived], automation_condition=REFRESH, kinds={"pandas"})
def recoverability(
    config: RecoveryConfig, store: CheckpointStoreResource, archive: ArchiveTierResource, pricing: PricingResource
) -> Output[pd.DataFrame]:
    """Is training recoverable right now? Per run: the newest recovery-ready checkpoint
    (step, age, tier), RPO against its target, the last recovery and its RTO, and
    "N of M need attention"; bytes and $/month per tier (priced as ``storage_cost``)."""
    view = recoverable.read_view(
        store.open(),
        archive.open(),
        model=pricing.model(archive),
        rpo_target_s=rpo_target_s(),
        window_s=parse_duration(config.window),
        detection_s=parse_duration(config.detection),
    )
    rows = [s.row(view.now) for s in view.runs]
    attention = [{"run": s.run, "step": step, "why": why} for s in view.runs for step, why in s.attention]
    need, total = recoverable.attention_counts(view.runs)
    metadata: dict = {
        "recoverable": MetadataValue.text(view.answer),
        "attention": MetadataValue.text(recoverable.attention_total(view.runs)),
        "status": _table(rows),
        "needing_attention": markdown(pd.DataFrame(attention, columns=["run", "step", "why"])),
        "tiers": markdown(pd.DataFrame(recoverable.tier_rows(view.cost))),
        "runs_recoverable": sum(1 for s in view.runs if s.recoverable),
        "runs_total": len(view.runs),
        "checkpoints_needing_attention": need,
        "checkpoints_total": total,
        **tier_cost_metadata(view.cost),
    }
    for s in view.runs:  # per-run keys: one plot per run, never one line through two runs
        if s.ready_age_s is not None:
            metadata[f"{s.run}/ready_age_s"] = MetadataValue.float(rounded(s.ready_age_s))
        metadata[f"{s.run}/attention"] = MetadataValue.int(len(s.attention))
    return Output(pd.DataFrame(rows, columns=COLUMNS), metadata=metadata)
