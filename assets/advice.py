"""``checkpoint_advice``: how often each run should checkpoint, and a WARN check when it is far off.

One row per run from ``ckptflow.reports.advice`` (the same numbers as ``ckptflow advise``):
the current and optimal intervals in steps and minutes, the expected loss per failure,
overhead, RPO and USD/month of each, and the fallbacks taken. The metadata carries, per run,
a text plot of the expected USD/month against the interval with the current and optimal
intervals marked. The check ``interval_near_optimum`` warns (non-blocking) when a run's
interval is more than ``MAX_RATIO`` times off its optimum, either way, unless the current
interval costs no more than the optimum found (``Advice.keep_current``).
"""

import math

import pandas as pd
from dagster import AssetCheckResult, AssetCheckSeverity, Config, MetadataValue, Output, asset, asset_check

from assets.checkpoints import checkpoint
from assets.inventory import GROUP, REFRESH, markdown
from ckptflow.catalog.listing import list_runs
from ckptflow.errors import CkptflowError
from ckptflow.policy import interval as model
from ckptflow.reports.advice import Advice, advise
from ckptflow.reports.units import human_duration
from resources import CheckpointStoreResource

MAX_RATIO = 2.0
PLOT_POINTS = 13
BAR = 40


class AdviceConfig(Config):
    """The failure rate: ``mtbf`` seconds, else ``scenario``, else measured (a preset when too little history)."""

    mtbf_s: float | None = None
    scenario: str | None = None
    gpus: int = 1
    gpu_hour_usd: float = 2.0


def _row(a: Advice) -> dict:
    row = {"run": a.run, "optimal_steps": a.optimal.interval_steps, "optimal_min": a.optimal.interval_s / 60}
    row["optimal_usd_month"] = a.optimal.total_usd_month
    row["keep_current"] = a.keep_current  # the current interval costs no more than the optimum found
    if a.current is not None:
        row |= {"current_steps": a.current.interval_steps, "current_min": a.current.interval_s / 60}
        row |= {"current_usd_month": a.current.total_usd_month, "ratio": a.current.interval_s / a.optimal.interval_s}
        row |= {"loss_per_failure_s": a.current.loss_per_failure_s, "overhead": a.current.save_overhead}
        row |= {"rpo_s": a.current.rpo_s}
    return row | {"mtbf_s": a.inputs.mtbf_s, "notes": "; ".join(a.notes)}


def plot(a: Advice) -> str:
    """Expected USD/month against the interval (log scale), current and optimal marked."""
    marks = {"optimal": a.optimal.interval_s, **({"current": a.current.interval_s} if a.current else {})}
    low, high = min(marks.values()) / 4, max(marks.values()) * 4
    points = sorted({*(low * (high / low) ** (k / (PLOT_POINTS - 1)) for k in range(PLOT_POINTS)), *marks.values()})
    costs = [model.evaluate(a.inputs, t).total_usd_month for t in points]
    top = max(costs) or 1.0
    lines = []
    for t, usd in zip(points, costs):
        label = " ".join(f"<- {name}" for name, at in marks.items() if math.isclose(at, t))
        lines.append(f"{human_duration(t):>9} {'#' * max(1, round(BAR * usd / top)):<{BAR}} {usd:,.2f} {label}")
    return "```\ninterval  USD/month\n" + "\n".join(lines) + "\n```"


@asset(group_name=GROUP, deps=[checkpoint], automation_condition=REFRESH, kinds={"pandas"})
def checkpoint_advice(config: AdviceConfig, store: CheckpointStoreResource) -> Output[pd.DataFrame]:
    """Per run: the checkpoint interval with the lowest expected USD/month next to the current one."""
    hot = store.open()
    rows, skipped = [], []
    metadata: dict[str, MetadataValue] = {}
    for run in list_runs(hot):
        try:
            a = advise(hot, run, mtbf_s=config.mtbf_s, scenario=config.scenario, gpus=config.gpus,
                       gpu_hour_usd=config.gpu_hour_usd)  # fmt: skip
        except CkptflowError as e:  # no checkpoint recording its cost yet: said, not fatal
            skipped.append(f"{run}: {e}")
            continue
        rows.append(_row(a))
        metadata[f"{run}/plot"] = MetadataValue.md(plot(a))
    df = pd.DataFrame(rows)
    metadata["table"] = markdown(df)
    metadata["runs_without_advice"] = MetadataValue.text("\n".join(skipped) or "none")
    return Output(df, metadata=metadata)


@asset_check(asset=checkpoint_advice, name="interval_near_optimum", blocking=False)
def interval_near_optimum(store: CheckpointStoreResource) -> AssetCheckResult:
    """Warns when a run checkpoints more than MAX_RATIO times more or less often than its optimum."""
    hot = store.open()
    off = {}
    for run in list_runs(hot):
        try:
            a = advise(hot, run)
        except CkptflowError:
            continue
        if a.current is not None and not a.keep_current:  # one that costs least is not off, whatever its ratio
            ratio = a.current.interval_s / a.optimal.interval_s
            if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
                off[run] = f"every {a.current.interval_steps} steps; optimum {a.optimal.interval_steps} ({ratio:.2g}x)"
    return AssetCheckResult(
        passed=not off,
        severity=AssetCheckSeverity.WARN,
        metadata={"runs_off": MetadataValue.md("\n".join(f"- {r}: {why}" for r, why in off.items()) or "none")},
    )
