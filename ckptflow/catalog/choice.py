"""What a selector's choice is made of (``ckptflow.catalog.selection``): the ``Choice``, and
which commit each tier holds at a step. A verdict, an evaluation, a score or an alias is
about one commit, and a tier may hold another commit of that step now (committed again
since, or by a newer ckptflow): the selectors check which before accepting a tier."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.catalog.verdicts import Unread
from ckptflow.errors import CkptflowError, NewerFormatError
from ckptflow.store.base import Store

FAILED = "failed validation"  # how a passed-over step whose verdict proved damage is described
NOT_VALIDATED = "not validated yet"  # how a step passed over for having no verdict yet is described
NEWER_COMMIT = "newer"  # the commit at a step a newer ckptflow wrote (not hex: no digest equals it)


@dataclass(frozen=True)
class Choice:
    """The candidates a selector accepts, in the order to try them, and the ones it did not."""

    label: str
    pairs: list[tuple[int, int]]  # (step, tier index), in the order to try
    passed_over: list[tuple[int, str]] = field(default_factory=list)  # (step, why it was not a candidate)
    exact: bool = False  # an exact step: no other step is ever tried
    # per (step, tier index) of ``pairs``, the commits (manifest digests) the selector accepted
    # there; a pair not in it: any. Restore loads only one of them: the step may be committed again
    # after the choice, and a step committed twice is ranked by each commit's own score
    commits: Mapping[tuple[int, int], frozenset[str]] = field(default_factory=dict)
    # why no candidate after ``pairs`` can be chosen: a record the choice rests on did not read
    # (an outage); once ``pairs`` are spent, restore raises StoreUnavailableError saying it
    stop: str | None = None


def stops_at(
    stores: Sequence[Store], run: str, step: int, tiers: list[int], blocked: Mapping[int, list[Unread]], known: Mapping
) -> str | None:
    """Why a choice stops at ``step``: a record it needs there did not read and may be about
    the commit a tier holds now (its absence would pass the step over on no proof); None
    when there is none, or each is about a commit no tier holds any more."""
    for record in blocked.get(step, []):
        if not on_this_commit(stores, run, step, tiers, {record.digest}, "", known)[1]:
            return (
                f"could not read the {record.kind} record {record.why}: a choice made without it could pass step "
                f"{step} over on no proof, so none was made past it. Fix access to the store and try again"
            )
    return None


def digest_in(
    stores: Sequence[Store], run: str, step: int, index: int, known: Mapping[tuple[int, int], str]
) -> str | None:
    """The digest of the commit at ``step`` in tier ``index`` (``known``, else read);
    ``NEWER_COMMIT`` when a newer ckptflow wrote it (a record, verdict or alias names an
    earlier commit: its format differs); None when it does not read (restore then tries
    it and reports the damage)."""
    if (step, index) in known:
        return known[(step, index)]
    try:
        return read_manifest(stores[index], run, step).digest
    except NewerFormatError:
        return NEWER_COMMIT
    except (CkptflowError, OSError):
        return None


def on_this_commit(
    stores: Sequence[Store],
    run: str,
    step: int,
    tiers: list[int],
    digests: set[str],
    what: str,
    known: Mapping[tuple[int, int], str],
    *,
    every: bool = False,
) -> tuple[list[int], str | None]:
    """The tiers of ``step`` to try for the commit ``digests`` name, and why none is (it
    was committed again since). Tiers are read in order (or looked up in ``known``) until
    one holds that commit; one holding another commit is left out, one that does not read
    is kept (restore tries it and reports why). ``every``: read every tier, not trusting
    those after the first that holds it: an alias chain may name another commit of the
    step, which only a later tier (the archive) holds."""
    kept: list[int] = []
    other: str | None = None
    for at, index in enumerate(tiers):
        digest = digest_in(stores, run, step, index, known)
        if digest in digests and not every:
            return kept + tiers[at:], None
        if digest in digests or digest is None:
            kept.append(index)
        elif other is None:
            other = digest
    # a tier that did not read may hold the commit (an outage proves nothing): restore tries it
    return (kept, None) if kept or other is None else ([], stale(what, digests, other))


def stale(what: str, digests: set[str], current: str) -> str:
    now = "one a newer ckptflow wrote" if current == NEWER_COMMIT else f"{current[:12]}…"
    return f"{what} commit {', '.join(sorted(d[:12] for d in digests))}…, not the commit there now ({now})"


def failed_now(
    stores: Sequence[Store], run: str, step: int, tiers: list[int], by_step: dict, known: Mapping
) -> str | None:
    """Why ``step`` is passed over as failed validation, or None: a verdict is about its
    commit, and the one there now (in its first tier) may be another, not checked yet."""
    verdicts = {d: k["validation"] for d, k in by_step.get(step, {}).items() if "validation" in k}
    if failed := {d: v for d, v in verdicts.items() if v.get("ok") is False}:
        now = digest_in(stores, run, step, tiers[0], known)
        failed = {d: v for d, v in failed.items() if d == now or now is None}
    return failed_why(failed.values()) if failed else None


def failed_why(verdicts: Iterable[Mapping[str, Any]]) -> str:
    """Why a commit whose ``verdicts`` (validation records) proved damage is passed over:
    ``FAILED`` (``selection.failed_steps`` reads it) and the first problems each records."""
    problems = "; ".join(str(p) for v in verdicts for p in (v.get("problems") or [])[:2])
    return f"{FAILED}: {problems or 'no problem recorded'}"
