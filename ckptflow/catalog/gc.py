"""Garbage collection: mark from every live manifest, sweep what nothing references.

A chunk is deleted only if no committed manifest references it AND it is older than
the grace period. A save in flight has written (or touched) chunks and rank records that
no manifest marks yet: its coordinator holds a lease from planning until its manifest is
committed, which covers every rank's writes (see ``leases``, ``dcp.commit_lease``); GC
takes a lock and waits for them, so nothing of a save in flight is swept, nor a chunk a
save is deciding to reuse. The grace period protects what is written without a lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog.listing import Problem
from ckptflow.chunks import damaged
from ckptflow.chunks import leases as lease_rules
from ckptflow.chunks.lease_listing import leases, wait_for_leases
from ckptflow.chunks.leases import GC_LOCK, LOCKS, Heartbeat, gc_lock
from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.sealed import MAX_RECORD_BYTES
from ckptflow.store import open_store
from ckptflow.store.base import ObjectInfo, Store

log = logging.getLogger("ckptflow")

PUT_BACK_ONLY_GRACE = "36500d"  # a gc with it settles killed deletes and sweeps nothing (but dead leases)
IGNORED_KINDS = ("bad_name", "not_a_directory")  # commit-record problems GC leaves alone: no restore reads them


@dataclass
class GCReport:
    dry_run: bool
    deleted: list[tuple[str, int]] = field(default_factory=list)  # (key, bytes)
    kept_chunks: int = 0
    live_manifests: int = 0
    unreadable_manifests: list[str] = field(default_factory=list)  # read by none, chunks kept as their JSON names
    ignored: list[str] = field(default_factory=list)  # directories ckptflow never writes, left alone
    dead_leases: list[str] = field(default_factory=list)  # leases of saves that died, cleared
    live_leases: list[str] = field(default_factory=list)  # saves in flight (a dry run lists what it would do)
    skipped: str | None = None  # why nothing was swept, when nothing could safely be
    restored: list[str] = field(default_factory=list)  # objects a killed conditional delete had taken aside

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.deleted)


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``90``, ``"90s"``, ``"15m"``, ``"1h"``, ``"7d"``; a finite number (a NaN
    grace would compare false with every age, and so protect nothing)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if isinstance(text, (int, float)):
            seconds = float(text)
        else:
            text = text.strip().lower()
            seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except (ValueError, OverflowError):
        raise ValueError(f"duration {text!r} is not understood; use e.g. 30s, 15m, 1h or 7d") from None
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} is not a finite number of seconds; use e.g. 30s, 15m, 1h or 7d")
    return seconds


def _salvage_chunks(store: Store, key: str) -> set[str] | None:
    """Chunks an unverifiable manifest may name, if its JSON still parses with a chunk
    map; None if it cannot. Every digest anywhere in it counts (the chunk map's keys, the
    items' references): a bit flipped in one place leaves the chunk named in the other."""
    try:
        doc = json.loads(store.get_bounded(key, MAX_RECORD_BYTES))
    except (ValueError, RecursionError, CkptflowError, OSError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("chunks"), dict):
        return None
    named: set[str] = set()
    stack: list[object] = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            named.update(k for k in node if fmt.is_digest(k))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and fmt.is_digest(node):
            named.add(node)
    return named


def chunks_kept_for(store: Store, problem: Problem) -> set[str] | None:
    """The chunks GC keeps for a commit record it cannot read: none for debris no restore
    could read (``IGNORED_KINDS``), every digest a damaged one's JSON still names (it might
    be repaired), or None where they cannot be told, and then GC sweeps nothing."""
    if problem.kind in IGNORED_KINDS:
        return set()
    if problem.kind == "corrupt" and problem.step is not None:
        return _salvage_chunks(store, fmt.manifest_key(problem.run, problem.step))
    return None


def _mark(store: Store, report: GCReport) -> tuple[set[str], list[ObjectInfo]] | None:
    """Referenced chunks, and step files no manifest owns; None if marking is unsafe (a
    commit record that cannot be read and whose chunks cannot be told: ``report.skipped``)."""
    live: set[str] = set()
    loose: list[ObjectInfo] = []
    listed = list(catalog_listing.listing(store))
    files = {(e.run, e.step): e.files for e in listed if isinstance(e, catalog_listing.StepListing)}
    for entry in listed:
        if isinstance(entry, catalog_listing.StepListing) and not entry.committed:
            loose.extend(entry.files)
    for item in catalog.committed(store, listed=listed):
        if isinstance(item, Manifest):
            report.live_manifests += 1
            live |= set(item.chunks)
            own = fmt.manifest_key(item.run, item.step)
            loose.extend(info for info in files[item.ref] if info.key != own and item.rank_of(info.key) is None)
            continue
        if item.kind in IGNORED_KINDS:  # nothing restore could read: leave it, say so
            report.ignored.append(str(item))
            continue
        salvaged = chunks_kept_for(store, item)
        if salvaged is None:
            then = (
                "run gc with a ckptflow that reads it"  # what a newer format references is unknown here
                if item.kind == "newer"
                else "inspect it, then delete it (or restore it from a copy) and run gc again"
            )
            report.skipped = (
                "a commit record cannot be read and its chunks cannot be told, so GC cannot tell what is "
                f"garbage: {item} — {then}"
            )
            return None
        report.unreadable_manifests.append(str(item))
        live |= salvaged  # an unverifiable manifest might still be repaired: keep its data
    return live, loose


def _stop_if_lost(store: Store, lock: Heartbeat | None, deleted: str | None = None) -> None:
    """Raise if ``lock`` was lost (taken over, or a save may have judged it dead): a GC that
    lost it decides no more. Lost by the time a delete returned (``deleted``), the GC may
    have stalled between its last check and that delete, long enough for a save to pass its
    lock and reuse that very object: nothing can bring it back, so it is named."""
    if lock is None or not lock.lost:
        return
    if deleted is not None:
        raise CkptflowError(
            f"garbage collection of {store.url} lost its lock ({GC_LOCK}) while it deleted {deleted}, and stopped: "
            "it stalled so long that a save may have judged it dead and reused that object meanwhile; run "
            "'ckptflow verify' on the checkpoints committed since this GC began (a damaged one is passed over by "
            "restore), then run GC again"
        )
    raise CkptflowError(
        f"garbage collection of {store.url} lost its lock ({GC_LOCK}) mid-sweep and stopped: another GC took it "
        "over, or it went unrenewed so long that a save may have judged it dead; run GC again (a GC that took it "
        "over finishes the job)"
    )


def gc(
    store: Store | str,
    grace: str | float = "1h",
    *,
    dry_run: bool = False,
    now: float | None = None,
    wait: float = 60.0,
    progress: Callable[[int], None] | None = None,
) -> GCReport:
    """Delete unreferenced chunks, stray rank records, temp files (and on a local store the
    empty directories of runs' steps: ``Store.stale_temp_files``) and the damage records of
    chunks no longer stored (``ckptflow.chunks.damaged``) older than ``grace``, and the
    leases of saves that died.

    Waits up to ``wait`` seconds for saves in flight (live leases, held from planning until
    the commit) to finish; if they do not, nothing is swept and ``report.skipped`` says why.
    First, a conditional delete killed midway is settled (``Store.settle_interrupted_deletes``:
    ``report.restored``); one too recent to settle sweeps nothing (a lock's excepted: it is
    never put back, so it hides no commit, and a later GC removes it). A dry run settles nothing
    but decides as a gc would: it lists nothing where a gc sweeps nothing, nor where a gc
    would first put back what a killed delete took (it cannot mark what is not back yet).
    ``progress`` is called
    with each deleted object's size (not on a dry run).
    """
    store = open_store(store)
    cutoff = (now if now is not None else time.time()) - parse_duration(grace)
    report = GCReport(dry_run=dry_run)
    with contextlib.nullcontext() if dry_run else gc_lock(store) as lock:
        held = leases(store) if dry_run else wait_for_leases(store, wait)
        report.dead_leases = [info.key for info in held.dead]
        report.live_leases = [info.key for info in held.live]
        if held.live and not dry_run:
            report.skipped = (
                f"{len(held.live)} save(s) are writing chunks ({held.live[0].key}, renewed within the last "
                f"{lease_rules.DEAD_AFTER:.0f} s); run gc again when they finish"
            )
            return report
        # before marking: a manifest put back protects its chunks; a dry run decides as a gc would
        settled = store.settle_interrupted_deletes(locks=LOCKS, dry_run=dry_run)
        if settled.pending:
            report.skipped = (
                f"{store.url}/{settled.pending[0]} was taken aside by a conditional delete under way, or killed "
                "less than a minute ago, so GC cannot tell whether it is a commit whose data must stay; "
                "run gc again in a minute"
            )
            return report
        if dry_run and settled.restored:  # what it holds is marked only once it is back, which a dry run is not
            report.skipped = (
                f"{store.url}/{settled.restored[0]} was taken aside by a conditional delete that was killed: a gc "
                "puts it back first and keeps what it references, which a dry run, writing nothing, cannot mark; "
                "to put it back and sweep nothing, run a gc whose grace no object outlives "
                f"(`ckptflow gc {store.url} --grace {PUT_BACK_ONLY_GRACE}`), then a dry run lists what a gc "
                "would delete"
            )
            return report
        report.restored = settled.restored
        marked = _mark(store, report)
        if marked is None:  # report.skipped says why
            return report
        live, loose = marked
        doomed = [info for info in loose if info.mtime < cutoff] + held.dead  # dead leases go whatever their age
        kept: set[str] = set()
        for info in store.list("chunks/"):
            digest = info.key.rsplit("/", 1)[-1]
            if digest in live or info.mtime >= cutoff:
                report.kept_chunks += 1
                kept.add(digest)
            else:
                doomed.append(info)
        records, why = damaged.listed(store)  # a chunk no longer stored needs no repair
        if records is None:
            log.warning("%s: GC leaves them for a GC that may list them", why)
        doomed += [info for digest, info in (records or {}).items() if digest not in kept and info.mtime < cutoff]
        # of the empty directories, those under runs/: every restore lists a step's directory as a candidate
        temps = [
            t for t in store.stale_temp_files(cutoff) if not t.key.endswith("/") or t.key.startswith(fmt.runs_prefix())
        ]
        report.deleted = [(info.key, info.size) for info in doomed + temps]
        if dry_run:
            return report
        for info in doomed:
            _stop_if_lost(store, lock)
            store.delete(info.key)
            _stop_if_lost(store, lock, info.key)
            if progress:
                progress(info.size)
        for info in temps:
            store.delete_temp(info.key)
            if progress:
                progress(info.size)
    return report
