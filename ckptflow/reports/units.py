"""Human units: how sizes, durations and money read to a person, the same in the CLI's tables
and in the Dagster layer's metadata (a separate module, so neither needs the other)."""

from __future__ import annotations

import math
from typing import Any

HOUR = 3600.0
DAY = 86400.0
YEAR = 365.25 * DAY
MANY_STEPS = 1e9


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
    """Microseconds or milliseconds under a second (three significant digits: a 12 ms save
    is "12 ms", not "0.0 s"), seconds up to two minutes, minutes up to two hours, hours up
    to a year, then years in three significant digits (an MTBF of 1e300 s is a few digits)."""
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + human_duration(-seconds)
    if 0 < seconds < 0.0009995:  # what rounds to 1000 µs or more is said in ms, 1000 ms or more in s
        return f"{seconds * 1e6:.3g} µs"
    if 0 < seconds < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < YEAR:
        return f"{seconds / 3600:.1f} h"
    years = f"{seconds / YEAR:.3g}"
    return f"{years} year" if years == "1" else f"{years} years"


def human_period(seconds: float) -> str:
    """A round duration a person chose (a preset MTBF) as it was chosen: whole days from two
    days on ("7 days", not "168 h"), whole hours below ("4 h", "24 h"); any other duration,
    and one of a year or more, as ``human_duration`` says it."""
    if 2 * DAY <= seconds < YEAR and (seconds / DAY).is_integer():
        return f"{int(seconds // DAY)} days"
    if HOUR <= seconds < YEAR and (seconds / HOUR).is_integer():
        return f"{int(seconds // HOUR)} h"
    return human_duration(seconds)


def human_steps(steps: float | None, *, unknown: str = "-") -> str:
    """A number of steps as it is: "2.5" for a run saving every 2 and 3 steps in turn (a
    median gap), "181" for a whole number, never rounded to a whole step it is not; to one
    decimal, which a median of whole gaps always is, so float noise (180.99999999999997,
    2.4999999999999996) does not show; past a billion, in three significant digits.
    ``unknown`` where there is no step time."""
    if steps is None:
        return unknown
    if steps >= MANY_STEPS:  # an optimum for a failure rate of never: its digits say nothing
        return f"{steps:.3g}"
    return f"{round(steps, 1):.1f}".removesuffix(".0")


def human_usd(amount: float | None, *, per: str = "") -> str:
    """Money as money: US dollars, cents from $1 up, three significant digits below (never
    e-notation: $0.000167, not 1.67e-04); ``per`` e.g. "/month"."""
    if amount is None:
        return "-"
    sign = "-" if amount < 0 else ""
    x = abs(float(amount))
    if x == 0 or x >= 1:
        return f"{sign}${x:,.2f}{per}"
    decimals = max(2, 2 - math.floor(math.log10(x)))  # three significant digits
    text = f"{x:.{decimals}f}"
    if decimals > 2:
        text = text.rstrip("0")
        text = text if len(text.split(".")[1]) >= 2 else f"{float(text):.2f}"
    return f"{sign}${text}{per}"


def human_saving(amount: float, *, per: str = "/month") -> str:
    """A saving, said as one: "saves $X/month", or "costs $X/month more" when it is negative
    (tiering while a checkpoint is still in both tiers, for instance), never "-$X saved"."""
    if amount < 0:
        return f"costs {human_usd(-amount, per=per)} more"
    return f"saves {human_usd(amount, per=per)}"


def rounded(value: Any, digits: int = 4) -> Any:
    """``value`` with every float to ``digits`` significant digits (a loss of 9.34805965423584
    reads 9.348), for display; ints, strings and structure unchanged."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value
