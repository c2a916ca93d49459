"""``storage_cost``: what the stores cost per month and what each saving bought.

A snapshot refreshed with the inventory. Prices are the deployment's ``pricing`` resource
(USD per GB-month per storage class, ckptflow's defaults being S3 list prices; see
``resources.pricing``), so the UI plots cost and savings over materializations as prices
or data change.
"""

import pandas as pd
from dagster import MetadataValue, Output, asset

from assets.checkpoints import archived, checkpoint, compressed
from assets.inventory import GROUP, REFRESH, markdown
from assets.pricing import tier_cost_metadata
from ckptflow.reports import costs
from ckptflow.reports.units import human_usd
from resources import ArchiveTierResource, CheckpointStoreResource, PricingResource


@asset(group_name=GROUP, deps=[checkpoint, compressed, archived], automation_condition=REFRESH, kinds={"pandas"})
def storage_cost(
    store: CheckpointStoreResource, archive: ArchiveTierResource, pricing: PricingResource
) -> Output[pd.DataFrame]:
    """Bytes and monthly cost per tier, and what retention, tiering, dedup, compression,
    delta and lossy archive codecs saved against keeping every checkpoint raw and hot; what
    garbage and the chunks held for unreadable commit records add and missing chunks
    subtract, each row saying which (``against_baseline``)."""
    report = costs.storage_costs(store.open(), archive.open(), model=pricing.model(archive))
    rows: list[dict] = [
        {"item": f"{t.tier} ({t.storage_class})", "bytes": t.stored_bytes, "usd_per_month": t.monthly_usd}
        for t in report.tiers
    ]
    rows.append(
        {"item": "every checkpoint raw and hot", "bytes": report.baseline_bytes, "usd_per_month": report.baseline_usd}
    )
    for name in costs.SAVINGS:  # each said as what it is, its size a size (``costs.item``)
        usd, nbytes = report.savings_usd[name], report.savings_bytes[name]
        label, way = costs.item(name, usd, nbytes)
        rows.append({"item": label, "bytes": abs(nbytes), "usd_per_month": abs(usd), "against_baseline": way})
    df = pd.DataFrame(rows)
    shown = df.assign(usd_per_month=[human_usd(v, per="/month") for v in df["usd_per_month"]])
    return Output(
        df,
        metadata={
            "monthly_usd": MetadataValue.float(report.monthly_usd),
            "baseline_usd": MetadataValue.float(report.baseline_usd),
            **tier_cost_metadata(report),
            **{f"saved_usd/{k}": MetadataValue.float(v) for k, v in report.savings_usd.items()},
            "monthly_cost": human_usd(report.monthly_usd, per="/month"),
            "baseline_cost": human_usd(report.baseline_usd, per="/month"),
            **{f"saving/{k}": costs.describe(k, v, report.savings_bytes[k]) for k, v in report.savings_usd.items()},
            "prices_date": report.prices_date,
            "table": markdown(shown),
        },
    )


__all__ = ["storage_cost"]
