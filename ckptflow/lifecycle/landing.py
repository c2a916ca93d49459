"""Landing: which commit records are new since a cursor, read from the store alone.

What is new is decided by the commit record itself, not by its step: a step can be
committed twice (restore rejected the first commit, training fell back and saved that
step again), and the second commit needs its own validation. So the cursor is a
watermark on the commit records' modification times (``{"t": newest seen, "seen":
[commits within SLACK of it]}``): a tick lists the store (names, sizes and times; no
reads), reads only the commit records at or after the watermark that it has not seen,
and names each commit by its manifest digest (``Landed.marker``). A commit that already
has a validation record for its digest (scrub, a promotion or the demo's in-process
driver wrote one) is ``validated``: a record is not the orchestrator's own verdict, so
whether it still needs a validation run is the orchestrator's to say (the landing sensor
requests one unless its ``checkpoint`` partition was materialized for that digest).

A tick does not list every step of every run: the cursor keeps, per run, the newest
step landed (its ``frontier``), and a tick lists each run from there on (S3
``StartAfter``: two requests per run when nothing is new, at 10,000 checkpoints as at
ten). A commit behind the frontier (a deeper fallback re-saving older steps, an import
of old steps) is found by the full listing a tick does every ``FULL_SCAN_S``; a step
committed again at the frontier (restore rejected the newest, training saved it anew)
is found at once. The full listing also drops the frontier of a run gone from the
store, so the cursor holds the runs the store holds.

A commit record whose time is behind the watermark by more than ``SLACK`` (a run copied
in with its times kept, ``cp -a`` or ``rsync -a``; a writer whose clock is behind) is
never fresh: the full listing lands it too, by its digest, unless that commit has a
validation record or is ``pending`` (``_behind_watermark``). The cursor keeps as
``pending`` each commit it landed that had no validation record, until a full listing
finds one (or the commit gone): it grows with the validation backlog only, at most
``MAX_WAITING``. A commit record proved damaged stays pending until it is gone (quarantined,
or committed again: a commit of its own), so each full listing does not land it again. The
digests come from each run's manifest index (one read per run once known) and the records
from one listing of their names, so a quick tick costs what it did.

A commit record that could not be read for a reason that may pass (a newer ckptflow
wrote it, access was denied) lands once without a digest, and its validation run says
why; the cursor keeps it as ``waiting`` and every full listing reads it again, so once
the code location is upgraded (or access fixed) it lands anew under its digest and
gets the validation it could not have (or, found damaged now, a run that records so).
At most ``MAX_WAITING`` are kept, the oldest dropped first (a backfill of the
validation job covers those).

``MAX_PER_TICK`` pages a large backlog: commits are taken oldest first and the
watermark moves only as far as the last one taken. ``SLACK`` absorbs clock skew
between writers of a shared store. A commit record that cannot be read for a
transient reason (the store is unavailable) stops the tick there and is retried.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog.records import is_number
from ckptflow.catalog.verdicts import Subject, read_record, subjects_with
from ckptflow.errors import ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

MAX_PER_TICK = 500
SLACK = 60.0  # seconds
FULL_SCAN_S = 300.0  # a tick lists every step of every run at least this often
MAX_WAITING = 5000  # unread commit records the cursor keeps to read again


@dataclass(frozen=True, kw_only=True)
class Landed:
    key: str  # the checkpoint's name (``format.checkpoint_name``)
    digest: str  # "" when the commit record could not be read (its validation will say why)
    marker: str  # what tells this commit from another commit of the same step
    validated: bool  # a validation record exists for this digest already


def land(store: Store, cursor: str | None, *, limit: int | None = None) -> tuple[list[Landed], str]:
    """``new_commits`` over a cursor as a sensor keeps it (JSON text, or None before the
    first tick), at most ``limit`` (None: ``MAX_PER_TICK`` as it is when called); a cursor
    of an older layout starts over (commits validated already are marked so)."""
    landed, after = new_commits(store, _cursor_state(cursor), MAX_PER_TICK if limit is None else limit)
    return landed, json.dumps(after, sort_keys=True)


def _cursor_state(cursor: str | None) -> dict:
    """The cursor as ``new_commits`` reads it; ``{}`` (start over) for one of a shape this
    code never writes (an older layout, or an operator's hand-edit), which would otherwise
    raise on every tick, or with a NaN watermark silently land nothing."""
    try:
        state = json.loads(cursor) if cursor else {}
    except (ValueError, RecursionError):
        return {}
    if not isinstance(state, dict):
        return {}
    seen, frontier = state.get("seen", []), state.get("frontier", {})
    sound = (
        # a tick that landed nothing yet keeps ``new_commits``'s start, -inf (JSON -Infinity)
        all(is_number(state[k]) or (k == "t" and state[k] == -math.inf) for k in ("t", "full_at") if k in state)
        and isinstance(seen, list)
        and all(isinstance(s, str) and math.isfinite(_seen_time(s)) for s in seen)
        and isinstance(frontier, dict)
        and all(type(v) is int for v in frontier.values())
    )
    return state if sound else {}


def _seen_time(seen_id: str) -> float:
    """The commit record's time a ``_seen_id`` ends with; NaN if it is not one."""
    try:
        return float(seen_id.rsplit("@", 1)[1])
    except (IndexError, ValueError):
        return math.nan


def _seen_id(entry: catalog_listing.StepListing) -> str:
    assert entry.manifest is not None
    return f"{entry.run}/{entry.step}@{entry.manifest.mtime!r}"


def new_commits(store: Store, cursor: dict, limit: int, now: float | None = None) -> tuple[list[Landed], dict]:
    """Commit records not yet landed (oldest first, at most ``limit``) and the cursor after them."""
    t = float(cursor.get("t", float("-inf")))
    seen = set(cursor.get("seen", []))
    frontier = {str(k): int(v) for k, v in dict(cursor.get("frontier", {})).items()}
    now = time.time() if now is None else now
    full_at = cursor.get("full_at")
    full = full_at is None or now - float(full_at) >= FULL_SCAN_S
    steps = list(catalog_listing.listing(store, from_steps=None if full else frontier, manifests_only=True))
    listed = [e for e in steps if isinstance(e, catalog_listing.StepListing)]
    fresh = [e for e in listed if e.manifest is not None and e.manifest.mtime >= t - SLACK and _seen_id(e) not in seen]
    waiting = _commit_ids(cursor.get("waiting"))
    pending = set(_commit_ids(cursor.get("pending")))
    landed: list[Landed] = []
    behind: list[catalog_listing.StepListing] = []
    if full:
        unlisted = [p for p in steps if isinstance(p, catalog_listing.Problem)]
        behind, pending = _behind_watermark(store, listed, t, set(waiting), pending)
        landed, waiting, landed_now = _read_again(store, waiting, listed, unlisted, limit)
        pending |= landed_now  # as the tick's own: no full listing lands them again
    order = sorted(fresh + behind, key=lambda e: (e.manifest.mtime, e.run, e.step))  # type: ignore[union-attr]
    taken = order[: max(0, limit - len(landed))]  # at most ``limit`` land a tick
    done: list[catalog_listing.StepListing] = []
    manifests = list(zip(taken, catalog.committed(store, listed=taken)))
    validated = _validated(store, [item for _, item in manifests])
    for (entry, item), was_validated in zip(manifests, validated):
        key = fmt.checkpoint_name(entry.run, entry.step)
        if isinstance(item, Manifest):
            landed.append(Landed(key=key, digest=item.digest, marker=item.digest[:16], validated=was_validated))
            if not was_validated:
                pending.add(_commit_id(entry))
        elif item.kind == "unavailable":
            break  # retried next tick: a store that did not answer proves nothing about the checkpoint
        else:
            marker = f"unreadable-{entry.manifest.mtime:.0f}"  # type: ignore[union-attr]
            landed.append(Landed(key=key, digest="", marker=marker, validated=False))
            if item.may_read_later:
                waiting.append(_commit_id(entry))
            else:  # damaged: no validation record will ever name it; kept so no full listing lands it again
                pending.add(_commit_id(entry))
        t = max(t, entry.manifest.mtime)  # type: ignore[union-attr]
        seen.add(_seen_id(entry))
        done.append(entry)
    seen = {s for s in seen if _seen_time(s) >= t - SLACK}
    # a full listing names every run the store holds: the frontier of a run gone from it is dropped
    held = (
        {p.run for p in steps if isinstance(p, catalog_listing.Problem)} | {e.run for e in listed if e.committed}
        if full
        else None
    )
    after = {"t": t, "seen": sorted(seen), "frontier": _frontier(frontier, listed, fresh, done, held=held)}
    newest = set(sorted(set(waiting), key=lambda w: (w[2], w[0], w[1]))[-MAX_WAITING:])
    after["waiting"] = [list(w) for w in dict.fromkeys(waiting) if w in newest]  # in the order to read them
    after["pending"] = [list(p) for p in sorted(pending, key=lambda p: (p[2], p[0], p[1]))[-MAX_WAITING:]]
    after["full_at"] = now if full else full_at
    return landed, after


def _behind_watermark(
    store: Store,
    listed: list[catalog_listing.StepListing],
    t: float,
    waiting: set[tuple[str, int, float]],
    pending: set[tuple[str, int, float]],
) -> tuple[list[catalog_listing.StepListing], set[tuple[str, int, float]]]:
    """Commits listed behind the watermark (older than ``t - SLACK``) that were never
    landed: neither ``pending`` nor ``waiting``, with no validation record for their
    digest (or a commit record that does not read); and the ``pending`` commits still
    listed without one."""
    looked_at = {
        _commit_id(e): e
        for e in listed
        if e.manifest is not None and (e.manifest.mtime < t - SLACK or _commit_id(e) in pending)
    }
    if not looked_at:
        return [], set()
    validated = subjects_with(store, "validation")
    unvalidated = set()
    for run in dict.fromkeys(e.run for e in looked_at.values()):
        committed = [e.manifest for e in listed if e.run == run and e.manifest is not None]
        summaries = catalog.summary_index(store, run).values(committed)
        for commit, entry in ((c, e) for c, e in looked_at.items() if e.run == run):
            summary = summaries[fmt.manifest_key(run, entry.step)]
            if isinstance(summary, ObjectNotFoundError):
                continue  # deleted since the listing
            if isinstance(summary, Exception) or (run, entry.step, summary["digest"]) not in validated:
                unvalidated.add(commit)
    never_landed = unvalidated - waiting - pending
    behind = [e for commit, e in looked_at.items() if commit in never_landed and commit[2] < t - SLACK]
    return behind, pending & unvalidated


def _commit_id(entry: catalog_listing.StepListing) -> tuple[str, int, float]:
    assert entry.manifest is not None
    return entry.run, entry.step, entry.manifest.mtime


def _commit_ids(value: object) -> list[tuple[str, int, float]]:
    """The cursor's waiting or pending commits; an entry this code never writes is
    dropped, not raised on every tick."""
    entries = value if isinstance(value, list) else []
    return [
        (w[0], w[1], float(w[2]))
        for w in entries
        if isinstance(w, list)
        and len(w) == 3
        and isinstance(w[0], str)
        and type(w[1]) is int
        and type(w[2]) in (int, float)
    ]


def _read_again(
    store: Store,
    waiting: list[tuple[str, int, float]],
    listed: list[catalog_listing.StepListing],
    unlisted: list[catalog_listing.Problem],
    limit: int,
) -> tuple[list[Landed], list[tuple[str, int, float]], set[tuple[str, int, float]]]:
    """Commit records landed unread, read again (at most ``limit``, in turn): those that read
    now land under their digest, those now proved damaged land to be recorded so; both are
    returned, to be kept ``pending`` as the tick's own are (one that reads, unless it has a
    validation record already). The others keep waiting, read again last. One the listing
    shows gone (deleted, or committed again: that commit lands as new), or unread for a
    reason that will not pass, is not waited for; one whose run or step could not be listed
    keeps waiting. An outage stops the reads."""
    by_id = {_commit_id(e): e for e in listed if e.committed}
    unknown = {(p.run, p.step) for p in unlisted}
    keep = [w for w in waiting if w not in by_id and ({(w[0], None), (w[0], w[1])} & unknown)]
    entries = [by_id[w] for w in waiting if w in by_id]
    keep += [_commit_id(e) for e in entries[limit:]]
    entries = entries[:limit]
    items = list(catalog.committed(store, listed=entries))
    landed: list[Landed] = []
    retried: list[tuple[str, int, float]] = []
    pending: set[tuple[str, int, float]] = set()
    for at, (entry, item, was_validated) in enumerate(zip(entries, items, _validated(store, items))):
        key = fmt.checkpoint_name(entry.run, entry.step)
        if isinstance(item, Manifest):
            landed.append(Landed(key=key, digest=item.digest, marker=item.digest[:16], validated=was_validated))
            if not was_validated:
                pending.add(_commit_id(entry))
        elif item.kind == "unavailable":
            retried += [_commit_id(e) for e in entries[at:]]
            break
        elif item.may_read_later:
            retried.append(_commit_id(entry))
        elif not item.could_not_read:
            marker = f"damaged-{entry.manifest.mtime:.0f}"  # type: ignore[union-attr]
            landed.append(Landed(key=key, digest="", marker=marker, validated=False))
            pending.add(_commit_id(entry))
    return landed, keep + retried, pending


def _validated(store: Store, items: list[Manifest | catalog_listing.Problem]) -> list[bool]:
    """Per commit record read, whether a validation record exists for its digest (read in parallel)."""

    def one(item: Manifest | catalog_listing.Problem) -> bool:
        return isinstance(item, Manifest) and read_record(store, Subject.of(item), "validation") is not None

    with ThreadPoolExecutor(16, thread_name_prefix="ckptflow-landing") as pool:
        return list(pool.map(one, items))


def _frontier(
    before: dict[str, int],
    listed: list[catalog_listing.StepListing],
    fresh: list,
    done: list[catalog_listing.StepListing],
    *,
    held: set[str] | None,
) -> dict[str, int]:
    """Per run, the step the next quick tick lists from: the newest committed step, or
    the oldest fresh commit this tick left for the next one (paging, an outage). Only
    runs in ``held`` (a full listing's runs, those it could not list included; None:
    every run) keep theirs: the cursor stays bounded by the runs the store holds, and a
    run made again under a deleted one's name is listed from its first step, not from
    the old run's newest."""
    out = {run: step for run, step in before.items() if held is None or run in held}
    for entry in listed:
        if entry.committed:
            out[entry.run] = max(out.get(entry.run, entry.step), entry.step)
    finished = set(done)
    for entry in (e for e in fresh if e not in finished):
        out[entry.run] = min(out[entry.run], entry.step)
    return out
