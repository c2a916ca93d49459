"""``ckptflow stats``'s cost section: bytes and monthly cost per tier, and what saved it."""

from __future__ import annotations

import argparse
import os
import stat

from ckptflow.cli.output import table
from ckptflow.errors import CkptflowError
from ckptflow.reports.costs import SAVINGS, CostModel, CostReport, item, storage_costs
from ckptflow.reports.units import human_bytes, human_usd
from ckptflow.store.base import Store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prices", metavar="FILE", help='JSON {"prices": {CLASS: USD per GB-month}, "tiers": {...}}')
    p.add_argument("--hot-class", help="storage class the hot store is priced as (default STANDARD)")
    p.add_argument("--archive-class", help="storage class of the archive (default GLACIER_IR)")


MAX_PRICES_BYTES = 1 << 20  # a price list is a few hundred bytes
PRICES_EXAMPLE = '{"prices": {"STANDARD": 0.023, "GLACIER_IR": 0.004}, "tiers": {"hot": "STANDARD"}}'


def read_prices(path: str | None) -> CostModel:
    """``--prices FILE`` as a cost model, the list prices without it; an error names the file
    and shows the format."""
    if not path:
        return CostModel()
    try:
        text = _prices_text(path)
    except OSError as e:
        raise CkptflowError(
            f"--prices {path}: cannot read it ({e.strerror or e}); pass a JSON file such as {PRICES_EXAMPLE}"
        ) from None
    except UnicodeDecodeError as e:
        raise CkptflowError(
            f"--prices {path}: byte {e.start} is not UTF-8 text; pass a JSON file such as {PRICES_EXAMPLE}"
        ) from None
    try:
        return CostModel.from_json(text)
    except ValueError as e:
        raise CkptflowError(f"--prices {path}: {e}; pass a JSON file such as {PRICES_EXAMPLE}") from None


def _prices_text(path: str) -> str:
    """The file's text, refused unread unless a regular file of at most ``MAX_PRICES_BYTES``
    (``--prices /dev/zero`` read without end)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise CkptflowError(f"--prices {path} is not a regular file; pass a JSON file such as {PRICES_EXAMPLE}")
    if info.st_size > MAX_PRICES_BYTES:
        raise CkptflowError(
            f"--prices {path} is larger than {MAX_PRICES_BYTES} bytes; refused unread: pass a JSON file such as "
            f"{PRICES_EXAMPLE}"
        )
    with open(path, "rb") as f:
        return f.read(MAX_PRICES_BYTES + 1).decode("utf-8")


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
