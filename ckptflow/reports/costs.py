"""The cost model: bytes per tier priced per storage class, and what each saving bought.

Prices are configuration (``CostModel``): USD per GB-month (1 GB = 2**30 bytes, as S3
bills) per storage class, and which class each tier is in. The defaults are AWS S3
list prices for us-east-1, first 50 TB per month (written down on ``PRICES_DATE``;
check https://aws.amazon.com/s3/pricing/ before relying on them).

``storage_costs`` compares what the stores hold with a baseline: every checkpoint
ever committed (held now, or expired by retention per the ``ledger``) kept raw and
hot. A checkpoint is a commit (its manifest digest): a step committed again after its
first commit expired, or held by another commit in the other tier, counts twice.
The difference is split into what each mechanism saved, per month:

* retention: checkpoints no longer held anywhere;
* tiering: held checkpoints priced in the archive's class instead of the hot one
  (negative while both tiers hold a copy: the duplicate is paid for);
* dedup: logical bytes the distinct chunks do not repeat (unchanged tensors, runs
  sharing data), per tier;
* compression, delta, lossy: raw minus stored bytes of plain (zstd), delta and
  lossy-copy chunks, per tier (delta net of the bases kept only for deltas; lossy
  also counts tensors a copy dropped);
* garbage: unreferenced chunk files waiting for GC (a cost, so negative);
* unreadable: chunk files GC keeps for commit records it cannot read (a cost, so
  negative): those the records' JSON still names (they might be repaired), or every
  unreferenced one where a record's chunks cannot be told (GC sweeps nothing then, so
  none of them is garbage "until gc": each stays until the record is repaired or deleted);
* missing: chunks referenced but absent, which the stores do not hold because they were
  lost (damage, no saving; apart from garbage, which netted with it made neither true).

The items add up exactly: baseline - savings = what the stores cost now. ``item`` says each
one as what it is, whichever way it came out ("saved by dedup", "garbage (unreferenced chunk
files, until gc)", "tiering costs more"), for the tables; ``describe`` says the same in a
sentence with its price, for metadata, from ``item``: one rule for both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.catalog.ledger import expired
from ckptflow.errors import CkptflowError
from ckptflow.policy.config_files import read_config_json
from ckptflow.reports.stats import StoreStats, store_stats
from ckptflow.reports.units import human_saving, human_usd
from ckptflow.store.base import Store

GB = float(1 << 30)
PRICES_DATE = "2026-11-30"
DEFAULT_PRICES = {  # USD per GB-month, AWS S3 us-east-1 list prices, first 50 TB / month
    "STANDARD": 0.023,
    "STANDARD_IA": 0.0125,
    "GLACIER_IR": 0.004,
    "DEEP_ARCHIVE": 0.00099,
}
DEFAULT_TIERS = {"hot": "STANDARD", "archive": "GLACIER_IR"}
SAVINGS = ("retention", "tiering", "dedup", "compression", "delta", "lossy", "garbage", "unreadable", "missing")
COST_ITEMS = {  # an item that came out negative, said as what it is: bytes held, not a choice that costs more
    "garbage": "garbage (unreferenced chunk files, until gc)",
    "unreadable": "chunks held for unreadable commit records (gc keeps them until each is repaired or deleted)",
    "delta": "delta bases (kept for deltas, more than the deltas saved)",
}
ONLY_ADDS = frozenset({"garbage", "unreadable"})  # items that never save: "saved by garbage" is false even at zero
NOT_SAVED = {  # an item subtracted from the baseline that saved nothing, said as what it is
    "missing": "missing chunks (referenced, absent: lost, not saved)",
}


@dataclass(frozen=True)
class CostModel:
    prices: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    tiers: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_TIERS))

    def __post_init__(self) -> None:
        for tier, storage_class in self.tiers.items():
            if storage_class not in self.prices:
                raise ValueError(
                    f"tier {tier!r} is priced as {storage_class!r}, which has no price; "
                    f"prices are given for {sorted(self.prices)}"
                )
        if any(
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < math.inf
            for p in self.prices.values()
        ):
            raise ValueError(f"prices must be finite non-negative numbers (USD per GB-month), got {dict(self.prices)}")

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """``{"prices": {"STANDARD": 0.023, ...}, "tiers": {"hot": "STANDARD", "archive": ...}}``;
        either key may be left out (defaults), and given prices extend the defaults."""
        return cls.from_doc(json.loads(text))

    @classmethod
    def from_doc(cls, doc: Any) -> CostModel:
        """``from_json``'s document, parsed."""
        if not isinstance(doc, dict):
            raise ValueError("a cost model is a JSON object with 'prices' and/or 'tiers'")
        prices, tiers = doc.get("prices", {}), doc.get("tiers", {})
        # checked here, so a file of the wrong shape is one ValueError naming the key, not a TypeError
        if not isinstance(prices, dict) or not isinstance(tiers, dict):
            raise ValueError(
                "'prices' must be an object {CLASS: USD per GB-month} and 'tiers' an object {TIER: CLASS}, "
                f"got {type(prices).__name__} and {type(tiers).__name__}"
            )
        if not all(isinstance(c, str) for c in tiers.values()):
            raise ValueError(f"'tiers' maps each tier to a storage class name, got {tiers}")
        return cls({**DEFAULT_PRICES, **prices}, {**DEFAULT_TIERS, **tiers})

    def with_classes(self, *, hot: str | None = None, archive: str | None = None) -> CostModel:
        tiers = dict(self.tiers)
        tiers.update({k: v for k, v in (("hot", hot), ("archive", archive)) if v})
        return CostModel(self.prices, tiers)

    def monthly(self, tier: str, nbytes: float) -> float:
        return nbytes / GB * self.prices[self.tiers[tier]]


MAX_PRICES_BYTES = 1 << 20  # a price list is a few hundred bytes
PRICES_EXAMPLE = '{"prices": {"STANDARD": 0.023, "GLACIER_IR": 0.004}, "tiers": {"hot": "STANDARD"}}'


def read_cost_model(path: str, *, given_as: str) -> CostModel:
    """The price file ``path`` as a cost model, for ``stats --prices`` and the Dagster
    ``CKPTFLOW_PRICES`` alike. Any file that reads (a pipe, ``/dev/stdin`` or a process
    substitution too), bounded (``read_config_json``): one that never ends (``/dev/zero``)
    or a pipe no process writes stops. An error says ``given_as`` (how the path was given),
    what is wrong and where, and shows the format."""
    try:
        return CostModel.from_doc(read_config_json(path, max_bytes=MAX_PRICES_BYTES))
    except ValueError as e:  # unreadable, past a bound, not JSON, or not of a price list's shape
        raise CkptflowError(f"{given_as}: {e}; name a JSON file such as {PRICES_EXAMPLE}") from None


@dataclass(frozen=True, kw_only=True)
class TierCost:
    tier: str
    storage_class: str
    price: float  # USD per GB-month
    stored_bytes: int  # every chunk file, referenced or not
    monthly_usd: float
    checkpoints: int


@dataclass(kw_only=True)
class CostReport:
    tiers: list[TierCost]
    baseline_bytes: int  # every checkpoint ever committed, raw
    baseline_usd: float  # ... kept hot
    savings_usd: dict[str, float]  # per mechanism, per month (negative: a cost)
    savings_bytes: dict[str, int]  # the same in bytes (tiering moves bytes, so it saves none)
    prices_date: str = PRICES_DATE

    @property
    def monthly_usd(self) -> float:
        return sum(t.monthly_usd for t in self.tiers)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tiers": [t.__dict__ for t in self.tiers],
            "baseline_bytes": self.baseline_bytes,
            "baseline_usd": self.baseline_usd,
            "monthly_usd": self.monthly_usd,
            "savings_usd": dict(self.savings_usd),
            "savings_bytes": dict(self.savings_bytes),
            "prices_date": self.prices_date,
        }


def storage_costs(hot: Store, archive: Store | None = None, *, model: CostModel | None = None) -> CostReport:
    """Bytes and monthly cost per tier, and the savings against every checkpoint raw and hot."""
    model = model or CostModel()
    stats = {"hot": store_stats(hot)}
    if archive is not None:
        stats["archive"] = store_stats(archive)
    return price(stats, expired(hot), model)


def price(stats: Mapping[str, StoreStats], expired_entries: list[dict], model: CostModel) -> CostReport:
    """The report for per-tier ``stats`` and the ledger of expired checkpoints (pure)."""
    held: dict[tuple[str, int, str], int] = {}  # by commit: a step committed again is another checkpoint
    for s in stats.values():
        for commit, h in s.held.items():
            held.setdefault(commit, h.exact_logical_bytes)
    gone = {(e["run"], e["step"], e.get("digest")): e["logical_bytes"] for e in expired_entries}
    gone = {commit: n for commit, n in gone.items() if commit not in held}
    baseline = sum(held.values()) + sum(gone.values())
    hot_price = model.monthly("hot", 1.0)
    usd = dict.fromkeys(SAVINGS, 0.0)
    nbytes = dict.fromkeys(SAVINGS, 0)
    usd["retention"], nbytes["retention"] = sum(gone.values()) * hot_price, sum(gone.values())
    tiers = []
    tiered = 0.0
    for tier, s in stats.items():
        unit = model.monthly(tier, 1.0)
        exact = sum(h.exact_logical_bytes for h in s.held.values())
        tiered += exact * unit
        kinds = s.encodings
        base = kinds.get("base")
        items = {
            "dedup": sum(h.logical_bytes for h in s.held.values()) - s.data_bytes,
            "compression": _saved(kinds, "plain"),
            "delta": _saved(kinds, "delta") - (base.stored_bytes if base else 0),  # bases kept for deltas cost
            "lossy": exact - sum(h.logical_bytes for h in s.held.values()) + _saved(kinds, "lossy"),
            # where a record's chunks cannot be told GC sweeps nothing: no unreferenced chunk goes "until gc"
            "garbage": 0 if s.garbage_untold else -s.unreferenced_bytes,
            "unreadable": -s.unreadable_record_bytes - (s.unreferenced_bytes if s.garbage_untold else 0),
            "missing": s.missing_raw_bytes,
        }
        for name, n in items.items():
            usd[name] += n * unit
            nbytes[name] += n
        stored = s.chunk_file_bytes
        tiers.append(
            TierCost(
                tier=tier,
                storage_class=model.tiers[tier],
                price=model.prices[model.tiers[tier]],
                stored_bytes=stored,
                monthly_usd=stored * unit,
                checkpoints=len(s.held),
            )
        )
    usd["tiering"] = sum(held.values()) * hot_price - tiered
    return CostReport(
        tiers=tiers,
        baseline_bytes=baseline,
        baseline_usd=baseline * hot_price,
        savings_usd=usd,
        savings_bytes=nbytes,
    )


def added_cost(name: str) -> str | None:
    """What an item of ``savings_usd`` that came out negative is, said plainly; None for
    tiering, the one item that compares two choices (archived against kept hot), which
    then "costs more" (a checkpoint in both tiers until the hot copy expires). Any other is
    bytes the stores hold and pay for (garbage: unreferenced chunk files until gc)."""
    return None if name == "tiering" else COST_ITEMS.get(name, name)


def describe(name: str, usd: float, nbytes: int, *, per: str = "/month") -> str:
    """One item of the report in words (the ``saving/<name>`` metadata), from ``item``, so
    it says what the table's row says: "saves $X/month" for a saving, "$X/month not paid
    for: <what it is>" (``NOT_SAVED``: missing chunks), "costs $X/month more" (tiering),
    "adds $X/month: <what it is>" (``added_cost``: garbage, even at $0, never "saves")."""
    label, way = item(name, usd, nbytes)
    if way == "subtracts":  # never a negative amount
        return f"{human_usd(usd, per=per)} not paid for: {label}" if name in NOT_SAVED else human_saving(usd, per=per)
    amount = human_usd(abs(usd), per=per)
    return f"costs {amount} more" if added_cost(name) is None else f"adds {amount}: {label}"


def item(name: str, usd: float, nbytes: int) -> tuple[str, str]:
    """(what an item of the report is, "subtracts" or "adds": which way it counts against the
    baseline), so a table can show its size as a size: "saved by <name>" only for a saving;
    a negative one as "tiering costs more" or what it holds (``added_cost``), missing chunks
    as what they are (``NOT_SAVED``). The way is the USD's, or the bytes' at a price of zero."""
    if usd < 0 or (usd == 0 and nbytes < 0) or name in ONLY_ADDS:
        plain = added_cost(name)
        return (f"{name} costs more" if plain is None else plain), "adds"
    return NOT_SAVED.get(name, f"saved by {name}"), "subtracts"


def _saved(kinds: Mapping[str, Any], kind: str) -> int:
    k = kinds.get(kind)
    return 0 if k is None else k.raw_bytes - k.stored_bytes
