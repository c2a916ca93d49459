"""``ckptflow stats``'s cost section: bytes and monthly cost per tier, and what saved it."""

from __future__ import annotations

import argparse

from ckptflow.cli.output import table
from ckptflow.errors import CkptflowError
from ckptflow.reports.costs import SAVINGS, CostModel, CostReport, item, read_cost_model, storage_costs
from ckptflow.reports.units import human_bytes, human_usd
from ckptflow.store.base import Store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prices", metavar="FILE", help='JSON {"prices": {CLASS: USD per GB-month}, "tiers": {...}}')
    p.add_argument("--hot-class", help="storage class the hot store is priced as (default STANDARD)")
    p.add_argument("--archive-class", help="storage class of the archive (default GLACIER_IR)")


def read_prices(path: str | None) -> CostModel:
    """``--prices FILE`` as a cost model (``read_cost_model``), the list prices without it."""
    return read_cost_model(path, given_as=f"--prices {path}") if path else CostModel()


def report(store: Store, args: argparse.Namespace, open_store) -> CostReport:
    try:
        model = read_prices(args.prices).with_classes(hot=args.hot_class, archive=args.archive_class)
    except ValueError as e:
        raise CkptflowError(f"cost model {args.prices or '(defaults)'}: {e}") from None
    return storage_costs(store, open_store(args.archive) if args.archive else None, model=model)


def render(costs: CostReport) -> str:
    tiers = table(
        ["TIER", "CLASS", "USD/GB-MONTH", "CHECKPOINTS", "STORED", "USD/MONTH"],
        [
            [
                t.tier,
                t.storage_class,
                f"{t.price:g}",
                str(t.checkpoints),
                human_bytes(t.stored_bytes),
                _usd(t.monthly_usd),
            ]
            for t in costs.tiers
        ],
        right={2, 3, 4, 5},
    )
    rows = [["every checkpoint raw and hot", human_bytes(costs.baseline_bytes), _usd(costs.baseline_usd)]]
    rows += [
        [
            _saving_label(name, costs),
            human_bytes(abs(costs.savings_bytes[name])),  # a size; the label says which way it counts
            _usd(abs(costs.savings_usd[name])),
        ]
        for name in SAVINGS
        if costs.savings_usd[name] or costs.savings_bytes[name]
    ]
    rows.append(["what the stores cost now", "", _usd(costs.monthly_usd)])
    savings = table(["", "BYTES", "USD/MONTH"], rows, right={1, 2})
    note = (  # the one comparison of choices: archiving a checkpoint against keeping it hot
        "\n(tiering costs more: a checkpoint still held in both tiers, paid twice until the hot copy expires)"
        if costs.savings_usd["tiering"] < 0
        else ""
    )
    return f"{tiers}\n\n{savings}{note}\n(list prices as of {costs.prices_date}; --prices FILE to use yours)"


def _usd(x: float) -> str:
    return human_usd(x)


def _saving_label(name: str, costs: CostReport) -> str:
    """What the item is (``reports.costs.item``: "saved by delta", "tiering costs more",
    "garbage (unreferenced chunk files, until gc)"), after "-" where it is subtracted from the
    baseline and "+" where it is added to it."""
    label, way = item(name, costs.savings_usd[name], costs.savings_bytes[name])
    return f"  {'-' if way == 'subtracts' else '+'} {label}"
