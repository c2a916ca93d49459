"""``ckptflow advise``: how often a run should checkpoint, next to how often it does."""

from __future__ import annotations

import argparse
import math

from ckptflow.cli.costs import read_prices
from ckptflow.cli.output import json_text, table
from ckptflow.errors import CkptflowError
from ckptflow.policy.interval import SCENARIOS, IntervalCost
from ckptflow.reports.advice import Advice, advise
from ckptflow.reports.units import human_duration, human_period, human_steps


def add_arguments(p: argparse.ArgumentParser, duration_arg) -> None:
    p.add_argument("--run", required=True)
    failures = p.add_mutually_exclusive_group()
    failures.add_argument(
        "--mtbf", type=duration_arg, help="mean time between failures of the job (e.g. 6h); default: measured"
    )
    failures.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        help="a preset MTBF: " + "; ".join(f"{k} {human_period(v[0])}" for k, v in sorted(SCENARIOS.items())),
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs the job holds (default 1)")
    p.add_argument("--gpu-hour-usd", type=float, default=2.0, help="price of one GPU-hour in USD (default 2.0)")
    p.add_argument("--prices", metavar="FILE", help='JSON {"prices": {CLASS: USD per GB-month}, "tiers": {...}}')
    p.add_argument("--json", action="store_true")


def run(store, args: argparse.Namespace) -> int:
    costs = read_prices(args.prices)
    if args.gpus < 1 or not 0 <= args.gpu_hour_usd < math.inf:
        raise CkptflowError(
            f"--gpus must be at least 1 and --gpu-hour-usd a finite non-negative number, got {args.gpus}, "
            f"{args.gpu_hour_usd}"
        )
    advice = advise(
        store,
        args.run,
        mtbf_s=args.mtbf,
        scenario=args.scenario,
        gpus=args.gpus,
        gpu_hour_usd=args.gpu_hour_usd,
        costs=costs,
    )
    print(json_text(advice.as_dict()) if args.json else render(advice))
    return 0


def render(advice: Advice) -> str:
    def row(name: str, c: IntervalCost, full_every: int | None) -> list[str]:
        return [
            name,
            human_steps(c.interval_steps),
            human_duration(c.interval_s),
            "-" if full_every is None else str(full_every),
            _loss(c.loss_per_failure_s),
            f"{100 * c.save_overhead:.2f}%",
            f"{100 * c.waste:.2f}%" if c.finishes else "never finishes",
            human_duration(c.rpo_s),
            f"{c.compute_usd_month:,.2f}",
            f"{c.storage_usd_month:,.2f}",
            f"{c.total_usd_month:,.2f}",
        ]

    rows = [row("optimal", advice.optimal, advice.full_every)]
    if advice.current is not None:
        rows.insert(0, row("current", advice.current, advice.current_full_every))
    headers = ["", "STEPS", "TIME", "FULL EVERY", "LOSS/FAILURE", "OVERHEAD", "WASTE", "RPO"]
    out = table([*headers, "LOST $/MO", "STORAGE $/MO", "TOTAL $/MO"], rows, right=set(range(1, 11)))
    i = advice.inputs
    current, optimal = advice.current, advice.optimal
    if advice.keep_current and current is not None:
        headline = (
            f"run {advice.run}: keep checkpointing {_every(current)}: the current interval costs least "
            f"(${current.total_usd_month:,.2f}/month; the best other found, {_every(optimal)}, "
            f"${optimal.total_usd_month:,.2f})"
        )
    elif advice.optimal.finishes:
        headline = (
            f"run {advice.run}: checkpoint {_every(optimal)}; "
            f"Young's first-order sqrt(2CM) = {human_duration(advice.young_s)}"
        )
    else:
        headline = f"run {advice.run}: no checkpoint interval is expected to finish (see the first note)"
    lines = [
        headline,
        "",
        out,
        "",
        "inputs:",
        f"  save (blocked) {human_duration(i.save_s)}   whole save {human_duration(i.save_duration_s)}   "
        f"restore {human_duration(i.restore_s)}   MTBF {human_duration(i.mtbf_s)}   "
        f"step {human_duration(i.step_time_s)}",
        *(f"  {name}: {source}" for name, source in advice.sources.items()),
    ]
    lines += [f"note: {n}" for n in advice.notes]
    return "\n".join(lines)


def _every(c: IntervalCost) -> str:
    """ "every 2.5 steps (1.2 s)", or "every 65.3 s" where no step time was measured."""
    if c.interval_steps is None:
        return f"every {human_duration(c.interval_s)}"
    return f"every {human_steps(c.interval_steps)} steps ({human_duration(c.interval_s)})"


def _loss(seconds: float) -> str:
    """Expected loss per failure (a restore many MTBFs long is years), inf as never."""
    return human_duration(seconds) if math.isfinite(seconds) else "never restored"
