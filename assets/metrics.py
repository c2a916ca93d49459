"""Operational numbers per run: checkpoint frequency, time to recovery-ready, recoveries
and their success rate. A snapshot of the store's records (``ckptflow.recoveries``),
refreshed with the inventory; each figure is numeric metadata, so the UI plots it over
materializations."""

import pandas as pd
from dagster import MetadataValue, Output, asset

from assets.checkpoints import checkpoint
from assets.inventory import GROUP, REFRESH, markdown
from ckptflow import recoveries
from resources import CheckpointStoreResource


@asset(group_name=GROUP, deps=[checkpoint], automation_condition=REFRESH, kinds={"pandas"})
def recovery_metrics(store: CheckpointStoreResource) -> Output[pd.DataFrame]:
    """Per run: checkpoints, median save interval, median commit-to-validated time,
    recoveries, successes, fallbacks and the median restore time."""
    rows = [m.as_dict() for m in recoveries.store_metrics(store.open())]
    df = pd.DataFrame(rows)
    total = sum(r["recoveries"] for r in rows)
    ok = sum(r["recoveries_ok"] for r in rows)
    ready = [r["ready_s"] for r in rows if r["ready_s"] is not None]
    metadata = {
        "runs": len(rows),
        "recoveries": total,
        "recoveries_ok": ok,
        "recovery_success_rate": MetadataValue.float(ok / total if total else 1.0),
        "fallbacks": sum(r["fallbacks"] for r in rows),
        "table": markdown(df),
    }
    if ready:
        metadata["median_ready_s"] = MetadataValue.float(float(pd.Series(ready).median()))
    return Output(df, metadata=metadata)
