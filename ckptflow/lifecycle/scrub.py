"""Scrub: re-verify old checkpoints (bit rot, lost objects) and record each verdict.

A checkpoint the store would not let it read (an outage) keeps its earlier verdict: it
is listed as unreadable, never recorded as failed; one a newer ckptflow wrote is listed
apart (``newer``), since no retry reads it. A chunk object found damaged is
recorded in the store (``ckptflow.chunks.damaged``): the next save of a job that holds
its content writes it anew, which repairs every checkpoint sharing it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import damaged
from ckptflow.errors import NewerFormatError, StoreUnavailableError
from ckptflow.format.manifest import Manifest
from ckptflow.lifecycle.validate import validate
from ckptflow.store.base import Store


@dataclass
class ScrubReport:
    checked: int = 0
    corrupt: list[tuple[str, int, str]] = field(default_factory=list)  # (run, step, problems)
    unreadable: list[str] = field(default_factory=list)  # checkpoints that could not be looked at: no verdict
    newer: list[str] = field(default_factory=list)  # written by a newer ckptflow: no verdict, retrying will not help
    damaged_chunks: int | None = None  # damage records in the store (``damaged``); None: they could not be listed
    records_error: str = ""  # why they could not be listed (the verdicts stand: no retry for it)


def scrub(store: Store, *, older_than_s: float = 86400.0, now: float | None = None) -> ScrubReport:
    """Validate every committed checkpoint created more than ``older_than_s`` ago (young
    ones were validated when they landed); each verdict is recorded for its digest."""
    cutoff = (time.time() if now is None else now) - older_than_s
    report = ScrubReport()
    for item in catalog.committed(store):
        if not isinstance(item, Manifest):
            if item.kind == "corrupt" and item.step is not None:
                report.corrupt.append((item.run, item.step, item.message))
            else:
                (report.newer if item.kind == "newer" else report.unreadable).append(str(item))
            continue
        if item.created_at >= cutoff:
            continue
        try:
            record = validate(store, item.run, item.step)
        except StoreUnavailableError as e:
            report.unreadable.append(str(e))
            continue
        except NewerFormatError as e:  # committed meanwhile by a newer writer
            report.newer.append(str(e))
            continue
        report.checked += 1
        if not record["ok"]:
            report.corrupt.append((item.run, item.step, "; ".join(record["problems"])))
    records, report.records_error = damaged.listed(store)  # the verdicts stand without the count
    report.damaged_chunks = None if records is None else len(records)
    return report
