"""How the Dagster layer writes metadata an operator reads at a glance.

Numbers stay numbers (Dagster plots numeric metadata across partitions and over
time), with a human-readable companion beside sizes; ratios and metrics are rounded
to what a person compares; identifiers that would only draw meaningless lines
(a step number, a base step) are text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster import MetadataValue

from assets.progress import rate
from ckptflow.lifecycle.evaluate import numeric
from ckptflow.reports.units import human_bytes

SIGNIFICANT = 4


def rounded(value: float, digits: int = SIGNIFICANT) -> float:
    """``digits`` significant digits: 0.09841234 -> 0.09841, 1234.5678 -> 1235.0."""
    return float(f"{value:.{digits}g}")


def size(name: str, n: int) -> dict[str, MetadataValue]:
    """``<name>_bytes`` (plotted) and ``<name>`` in human units, side by side."""
    return {f"{name}_bytes": MetadataValue.int(int(n)), name: MetadataValue.text(human_bytes(n))}


def throughput(name: str, n: int, seconds: float) -> dict[str, MetadataValue]:
    """``<name>_seconds`` and ``<name>_mb_per_s`` (``n`` bytes in ``seconds``), plotted
    across partitions: a tier or network slowing down shows as a falling line. No rate
    for an instant."""
    timed: dict[str, MetadataValue] = {f"{name}_seconds": MetadataValue.float(rounded(seconds, 3))}
    mbs = rate(n, seconds)
    if mbs is not None:
        timed[f"{name}_mb_per_s"] = MetadataValue.float(rounded(mbs, 3))
    return timed


def ratio(value: float | None) -> MetadataValue:
    return MetadataValue.float(round(value if value is not None else 1.0, 3))


def metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, MetadataValue]:
    """Finite numeric values, rounded, as floats (what the UI plots over partitions)."""
    return {f"{prefix}{k}": MetadataValue.float(rounded(v)) for k, v in numeric(values).items()}


def bullet_list(lines: list[str], *, empty: str = "none", limit: int = 20) -> MetadataValue:
    shown = [f"- {line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"- … {len(lines) - limit} more")
    return MetadataValue.md("\n".join(shown) or empty)
