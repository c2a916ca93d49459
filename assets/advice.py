"""``checkpoint_advice``: how often each run should checkpoint, and a WARN check when it is far off.

One row per run from ``ckptflow.reports.advice`` (the same numbers as ``ckptflow advise``):
the current and optimal intervals in steps and minutes (``current_from``: where the current
one was read), the expected loss per failure,
overhead, RPO and USD/month of each, and the fallbacks taken. The metadata carries, per run,
a text plot of the expected USD/month against the interval with the current and optimal
intervals marked. The check ``interval_near_optimum`` warns (non-blocking) when a run's
interval is more than ``MAX_RATIO`` times off its optimum, either way, unless the current
interval costs no more than the optimum found (``Advice.keep_current``); it reads the
asset's rows, so it judges by the config the asset was materialized with.
"""

import pandas as pd
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    Config,
    JsonMetadataValue,
    MetadataValue,
    Output,
    asset,
    asset_check,
)

from assets.checkpoints import checkpoint
from assets.inventory import GROUP, REFRESH, markdown
from ckptflow.catalog.listing import list_runs
from ckptflow.catalog.records import is_number
from ckptflow.errors import CkptflowError
from ckptflow.policy import interval as model
from ckptflow.reports.advice import Advice, advise, check_failure_rate
from ckptflow.reports.units import human_duration, human_steps
from resources import CheckpointStoreResource

MAX_RATIO = 2.0
PLOT_POINTS = 13
BAR = 40
JUDGED = ("ratio", "keep_current", "current_steps", "optimal_steps")  # what interval_near_optimum reads of a row


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
        row["current_from"] = a.sources.get("current")  # an adaptive run's decision, or the gaps between commits
        row |= {"current_usd_month": a.current.total_usd_month, "ratio": a.current.interval_s / a.optimal.interval_s}
        row |= {"loss_per_failure_s": a.current.loss_per_failure_s, "overhead": a.current.save_overhead}
        row |= {"rpo_s": a.current.rpo_s}
    return row | {"mtbf_s": a.inputs.mtbf_s, "notes": "; ".join(a.notes)}


def plot(a: Advice) -> str:
    """Expected USD/month against the interval (log scale), current and optimal marked. The
    curve is the advised full/incremental mix; each marked point is its row of the table,
    the current one at the run's own mix (as ``ckptflow advise`` prices it)."""
    marks = [("optimal", a.optimal), *([("current", a.current)] if a.current is not None else [])]
    low = min(c.interval_s for _, c in marks) / 4
    high = max(c.interval_s for _, c in marks) * 4
    curve = (low * (high / low) ** (k / (PLOT_POINTS - 1)) for k in range(PLOT_POINTS))
    points = [(t, model.evaluate(a.inputs, t).total_usd_month, "") for t in curve]
    points += [(c.interval_s, c.total_usd_month, f"<- {name}{_own_mix(a, name)}") for name, c in marks]
    points.sort(key=lambda p: p[0])
    top = max(usd for _, usd, _ in points) or 1.0
    lines = [
        f"{human_duration(t):>9} {'#' * max(1, round(BAR * usd / top)):<{BAR}} {usd:,.2f} {label}".rstrip()
        for t, usd, label in points
    ]
    return "```\ninterval  USD/month\n" + "\n".join(lines) + "\n```"


def _own_mix(a: Advice, name: str) -> str:
    """Where the current point is priced at a mix other than the curve's, it says which."""
    if name == "current" and a.current_full_every != a.full_every:
        return f" (its own mix: a full every {a.current_full_every})"
    return ""


@asset(group_name=GROUP, deps=[checkpoint], automation_condition=REFRESH, kinds={"pandas"})
def checkpoint_advice(config: AdviceConfig, store: CheckpointStoreResource) -> Output[pd.DataFrame]:
    """Per run: the checkpoint interval with the lowest expected USD/month next to the current one."""
    check_failure_rate(mtbf_s=config.mtbf_s, scenario=config.scenario)  # a bad setting fails, not each run
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
    metadata["intervals"] = MetadataValue.json({r["run"]: {k: r.get(k) for k in JUDGED} for r in rows})
    return Output(df, metadata=metadata)


@asset_check(asset=checkpoint_advice, name="interval_near_optimum", blocking=False)
def interval_near_optimum(context: AssetCheckExecutionContext) -> AssetCheckResult:
    """Warns when a run checkpoints more than MAX_RATIO times more or less often than its optimum.

    It judges the asset's own rows, not advice computed again: those were priced with the
    operator's ``AdviceConfig`` (MTBF, scenario, GPUs and their price), which a check run
    with the defaults would not know, and warned about an interval the asset calls optimal.
    It reads them from the newest materialization's ``intervals``, not through the IO
    manager: run before the asset was ever materialized, loading its DataFrame failed with
    Dagster's own FileNotFoundError. With nothing to judge it fails (WARN, as for a run off
    its optimum: a check that cannot judge must not pass) and says to materialize the asset."""
    event = context.instance.get_latest_materialization_event(checkpoint_advice.key)
    materialization = event.asset_materialization if event is not None else None
    intervals = materialization.metadata.get("intervals") if materialization is not None else None
    if not isinstance(intervals, JsonMetadataValue) or not isinstance(intervals.value, dict):
        if materialization is None:
            why = "has not been materialized on this instance"
        else:
            why = "was last materialized by an earlier ckptflow, without the intervals this check judges"
        return AssetCheckResult(
            passed=False,
            severity=AssetCheckSeverity.WARN,
            description=f"checkpoint_advice {why}, so there is no advice to judge the runs' intervals by: "
            "materialize checkpoint_advice first, then run this check again",
            metadata={"runs_off": MetadataValue.text("not judged")},
        )
    off, unread = {}, []
    for run, row in intervals.value.items():
        if not _judgeable(row):
            unread.append(run)
            off[run] = "not judged: its entry in the intervals metadata is not of the shape checkpoint_advice writes"
            continue
        ratio = row.get("ratio")
        if ratio is None or row["keep_current"]:  # one that costs least is not off
            continue
        if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
            current, optimal = human_steps(row.get("current_steps")), human_steps(row.get("optimal_steps"))
            off[run] = f"every {current} steps; optimum {optimal} ({ratio:.2g}x)"
    return AssetCheckResult(
        passed=not off,
        severity=AssetCheckSeverity.WARN,
        description=f"{len(unread)} run(s) not judged ({', '.join(unread)}): their entries in checkpoint_advice's "
        "newest intervals metadata cannot be read; materialize checkpoint_advice again, then run this check"
        if unread
        else None,
        metadata={"runs_off": MetadataValue.md("\n".join(f"- {r}: {why}" for r, why in off.items()) or "none")},
    )


def _judgeable(row: object) -> bool:
    """Whether an entry of the ``intervals`` metadata has the shape ``checkpoint_advice`` writes
    (``JUDGED``): one reported by hand or written otherwise crashed the check (a missing key,
    a ratio in quotes compared with a number), and a check that cannot judge a run must say so."""
    if not isinstance(row, dict) or type(row.get("keep_current")) is not bool:
        return False
    return all(row.get(k) is None or is_number(row[k], minimum=0) for k in ("ratio", "current_steps", "optimal_steps"))
