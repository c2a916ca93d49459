"""Human units: how sizes and durations read to a person, the same in the CLI's tables
and in the Dagster layer's metadata (a separate module, so neither needs the other)."""

from __future__ import annotations


def human_bytes(n: int | float) -> str:
    """Binary units, one decimal: what `ls -h` users expect."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def human_duration(seconds: float | None) -> str:
    """Seconds up to two minutes, minutes up to two hours, then hours."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
