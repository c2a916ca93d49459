"""One price list for every asset that says what storage costs.

``storage_cost``, ``checkpoint_inventory`` and ``recoverability`` all price tiers with
the ``pricing`` resource (``resources.pricing``) and write them with ``tier_cost_metadata``,
so the same archive reads the same $/month everywhere (the inventory used to round its
own figure to 4 decimals and show ``archive_monthly_usd 0`` where the cost report said
$0.0000225).
"""

from dagster import MetadataValue

from assets.metadata import size
from ckptflow.reports import costs
from ckptflow.reports.units import human_usd


def tier_cost_metadata(report: costs.CostReport) -> dict[str, MetadataValue]:
    """Per tier: stored bytes and $/month as plotted numbers (never rounded away), and the
    cost as money beside them. Bytes are every chunk file
    the tier bills for (referenced or not)."""
    out: dict[str, MetadataValue] = {}
    for t in report.tiers:
        out[f"{t.tier}_monthly_usd"] = MetadataValue.float(t.monthly_usd)
        out.update(size(f"{t.tier}_stored", t.stored_bytes))
        out[f"{t.tier}_cost"] = MetadataValue.text(human_usd(t.monthly_usd, per="/month"))
    return out
