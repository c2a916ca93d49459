"""Garbage collection: mark from every live manifest, sweep what nothing references.

A chunk is deleted only if no committed manifest references it AND it is older than
the grace period. The grace period must exceed the slowest save: a save in flight has
written (or touched) its chunks but not yet committed the manifest that marks them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.errors import ManifestError
from ckptflow.store.base import Store
from ckptflow.store.local import LocalStore
from ckptflow.store import open_store


@dataclass
class GCReport:
    dry_run: bool
    deleted: list[tuple[str, int]] = field(default_factory=list)  # (key, bytes)
    kept_chunks: int = 0
    live_manifests: int = 0
    unreadable_manifests: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.deleted)


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ValueError(f"duration {text!r} is not understood; use e.g. 30s, 15m, 1h or 7d") from None


def gc(
    store: Store | str,
    grace: str | float = "1h",
    *,
    dry_run: bool = False,
    now: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> GCReport:
    """Delete unreferenced chunks, orphaned rank records and temp files older than ``grace``.

    ``progress`` is called with each deleted object's size (not on a dry run).
    """
    store = open_store(store)
    cutoff = (now if now is not None else time.time()) - parse_duration(grace)
    report = GCReport(dry_run=dry_run)
    live: set[str] = set()
    orphans = []
    for run in catalog.list_runs(store):
        for step in catalog.list_steps(store, run):
            try:
                manifest, _ = catalog.read_manifest(store, run, step)
            except ManifestError as e:
                if store.exists(fmt.manifest_key(run, step)):
                    report.unreadable_manifests.append(str(e))
                else:
                    orphans.extend(store.list(fmt.step_prefix(run, step)))
                continue
            report.live_manifests += 1
            live.update(catalog.referenced_chunks(manifest))
    doomed = [info for info in orphans if info.mtime < cutoff]
    for info in store.list("chunks/"):
        digest = info.key.rsplit("/", 1)[-1]
        if digest in live or info.mtime >= cutoff:
            report.kept_chunks += 1
        else:
            doomed.append(info)
    report.deleted = [(info.key, info.size) for info in doomed]
    temps = list(store.stale_temp_files(cutoff)) if isinstance(store, LocalStore) else []
    report.deleted += [(info.key, info.size) for info in temps]
    if not dry_run:
        for info in doomed:
            store.delete(info.key)
            if progress:
                progress(info.size)
        for info in temps:
            store.delete_temp(info.key)
            if progress:
                progress(info.size)
    return report
