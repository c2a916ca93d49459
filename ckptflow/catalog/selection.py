"""What a restore recovers to: which checkpoints a selector accepts, in the order to try them.

"The most recent checkpoint might be corrupted; the most recent validated one is safer; the
best-performing one suits trying other approaches." A selector names that choice:

- ``"latest"`` (the default): every checkpoint, newest first (restore's own fallback past damage);
- ``"validated"``: only commits with a passing validation verdict on that exact manifest
  digest, newest first; a newer one that failed or has no verdict yet is passed over;
- ``Best(metric, mode)``: commits with a ``metric`` in their evaluation record, best first
  (ties: newer first); one that failed validation is passed over;
- ``Alias(model, alias)``: the commit a registry alias of ``model`` was published from,
  then the aliases below it (``latest`` -> ``stable`` -> ``fallback``);
- an ``int``: exactly that step, never another.

Each falls back only within its own meaning: a damaged validated checkpoint moves the restore
to the next validated one, never to an unvalidated one. What a selector did not accept is
returned with the reason (``Choice.passed_over``), so the restore result and the recovery
record say why a newer checkpoint was not loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptflow.catalog import aliases as alias_records
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.catalog.selectors import ALIAS_CHAIN, Alias, Best, Selector, describe
from ckptflow.catalog.selectors import check as check
from ckptflow.catalog.selectors import from_arguments as from_arguments
from ckptflow.catalog.selectors import parse as parse
from ckptflow.catalog.selectors import registry_store as registry_store
from ckptflow.catalog.verdicts import Unread, records_by_subject
from ckptflow.errors import CkptflowError, NewerFormatError, RegistryError
from ckptflow.store.base import Store

FAILED = "failed validation"  # how a passed-over step whose verdict proved damage is described
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
    # after the choice, and a step committed twice is ranked by each commit's own evaluation
    commits: Mapping[tuple[int, int], frozenset[str]] = field(default_factory=dict)
    # why no candidate after ``pairs`` can be chosen: a record the choice rests on did not read
    # (an outage); once ``pairs`` are spent, restore raises StoreUnavailableError saying it
    stop: str | None = None


def choose(
    stores: Sequence[Store],
    run: str,
    select: Selector,
    pairs: list[tuple[int, int]],
    registry: Store | None = None,
    *,
    digests: Mapping[tuple[int, int], str] | None = None,
) -> Choice:
    """Order and filter ``pairs`` (restore's candidates across tiers, newest first) for
    ``select``. Verdicts and evaluations are read from ``stores[0]`` (the hot store, where
    the lifecycle records them); a registry alias from ``registry`` (default: the hot store).
    ``digests``: the commit each (step, tier index) of ``pairs`` holds when the caller
    knows it (the inventory read them all), so no manifest is read to check that a
    verdict is about the commit there now."""
    known = dict(digests or {})
    label = describe(select)
    if isinstance(select, int):
        return Choice(label, [p for p in pairs if p[0] == select], exact=True)
    if select == "latest":
        return Choice(label, pairs)
    held: dict[int, list[int]] = {}
    for step, index in pairs:
        held.setdefault(step, []).append(index)
    if isinstance(select, Alias):
        return _by_alias(stores, run, select, held, registry or stores[0], known)
    needed = ("validation",) if select == "validated" else ("validation", "evaluation")
    unread: list[Unread] = []
    records = records_by_subject(stores[0], run, unread=unread)
    by_step: dict[int, dict[str, dict]] = {}
    for (_, step, digest), kinds in records.items():
        by_step.setdefault(step, {})[digest] = kinds
    blocked: dict[int, list[Unread]] = {}
    for u in unread:
        if u.kind in needed and u.step in held:
            blocked.setdefault(u.step, []).append(u)
    if select == "validated":
        return _validated(stores, run, label, held, by_step, known, blocked)
    assert isinstance(select, Best)
    return _best(stores, run, select, held, by_step, known, blocked)


def _stops_at(
    stores: Sequence[Store], run: str, step: int, tiers: list[int], blocked: Mapping[int, list[Unread]], known: Mapping
) -> str | None:
    """Why a choice stops at ``step``: a record it needs there did not read and may be about
    the commit a tier holds now (its absence would pass the step over on no proof); None
    when there is none, or each is about a commit no tier holds any more."""
    for record in blocked.get(step, []):
        if not _on_this_commit(stores, run, step, tiers, {record.digest}, "", known)[1]:
            return (
                f"could not read the {record.kind} record {record.why}: a choice made without it could pass step "
                f"{step} over on no proof, so none was made past it. Fix access to the store and try again"
            )
    return None


def _digest_in(
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


def _on_this_commit(
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
        digest = _digest_in(stores, run, step, index, known)
        if digest in digests and not every:
            return kept + tiers[at:], None
        if digest in digests or digest is None:
            kept.append(index)
        elif other is None:
            other = digest
    # a tier that did not read may hold the commit (an outage proves nothing): restore tries it
    return (kept, None) if kept or other is None else ([], _stale(what, digests, other))


def not_the_commit_accepted(accepted: frozenset[str], current: str) -> str:
    """Why a step's commit read at restore is passed over: the selector accepted another."""
    return _stale("the selector accepted", set(accepted), current) + "; committed again since, or not read then"


def _stale(what: str, digests: set[str], current: str) -> str:
    now = "one a newer ckptflow wrote" if current == NEWER_COMMIT else f"{current[:12]}…"
    return f"{what} commit {', '.join(sorted(d[:12] for d in digests))}…, not the commit there now ({now})"


def _validated(
    stores: Sequence[Store],
    run: str,
    label: str,
    held: dict[int, list[int]],
    by_step: dict[int, dict[str, dict]],
    known: Mapping[tuple[int, int], str],
    blocked: Mapping[int, list[Unread]],
) -> Choice:
    """Newest first; the walk stops at a step with an unread validation record (``blocked``)
    that no read verdict makes a candidate: that record may be the one that passed."""
    pairs: list[tuple[int, int]] = []
    passed: list[tuple[int, str]] = []
    commits: dict[tuple[int, int], frozenset[str]] = {}
    for step in sorted(held, reverse=True):
        ok = {d for d, k in by_step.get(step, {}).items() if k.get("validation", {}).get("ok") is True}
        tiers, stale = (
            _on_this_commit(stores, run, step, held[step], ok, "validation passed on", known) if ok else ([], None)
        )
        if not tiers and (stop := _stops_at(stores, run, step, held[step], blocked, known)):
            return Choice(label, pairs, passed, commits=commits, stop=stop)
        if not ok:
            passed.append((step, _failed_now(stores, run, step, held[step], by_step, known) or "not validated yet"))
            continue
        if stale:
            passed.append((step, stale))
            continue
        pairs += [(step, i) for i in tiers]
        commits.update({(step, i): frozenset(ok) for i in tiers})
    return Choice(label, pairs, passed, commits=commits)


def _failed_now(
    stores: Sequence[Store], run: str, step: int, tiers: list[int], by_step: dict, known: Mapping
) -> str | None:
    """Why ``step`` is passed over as failed validation, or None: a verdict is about its
    commit, and the one there now (in its first tier) may be another, not checked yet."""
    verdicts = {d: k["validation"] for d, k in by_step.get(step, {}).items() if "validation" in k}
    if failed := {d: v for d, v in verdicts.items() if v.get("ok") is False}:
        now = _digest_in(stores, run, step, tiers[0], known)
        failed = {d: v for d, v in failed.items() if d == now or now is None}
    problems = "; ".join(str(p) for v in failed.values() for p in (v.get("problems") or [])[:2])
    return f"{FAILED}: {problems or 'no problem recorded'}" if failed else None


def _best(
    stores: Sequence[Store],
    run: str,
    select: Best,
    held: dict[int, list[int]],
    by_step: dict[int, dict[str, dict]],
    known: Mapping[tuple[int, int], str],
    blocked: Mapping[int, list[Unread]],
) -> Choice:
    """Best first. A step with an unread validation or evaluation record (``blocked``) may
    be the best or a failed one, so no choice is made then (``Choice.stop``); unless the
    record cannot make its commit a candidate (``_may_rank``)."""
    ranking = {
        step: [u for u in unread if _may_rank(u, by_step.get(step, {}), select)] for step, unread in blocked.items()
    }
    for step in sorted(ranking, reverse=True):
        if stop := _stops_at(stores, run, step, held[step], ranking, known):
            return Choice(describe(select), [], stop=stop)
    scored: list[tuple[float, int, int]] = []  # (the score of the commit a tier holds, step, tier index)
    passed: list[tuple[int, str]] = []
    commits: dict[tuple[int, int], frozenset[str]] = {}
    for step in sorted(held, reverse=True):
        values: dict[str, float] = {}
        for digest, kinds in by_step.get(step, {}).items():
            value = (kinds.get("evaluation", {}).get("metrics") or {}).get(select.metric)
            valid = kinds.get("validation", {}).get("ok") is not False
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and valid:
                values[digest] = float(value)
        if not values:
            why = _failed_now(stores, run, step, held[step], by_step, known)
            passed.append((step, why or f"no evaluation of {select.metric!r}"))
            continue
        tiers, stale = _scored_tiers(stores, run, step, held[step], values, select.mode, known)
        if stale:
            passed.append((step, stale))
            continue
        for value, index, accepted in tiers:
            scored.append((value, step, index))
            commits[(step, index)] = accepted
    sign = 1 if select.mode == "min" else -1
    scored.sort(key=lambda t: (sign * t[0], -t[1]))  # stable: a step's tiers of one score keep their order
    pairs = [(step, index) for _, step, index in scored]
    return Choice(describe(select), pairs, passed, commits=commits)


def _may_rank(record: Unread, commits: Mapping[str, dict], select: Best) -> bool:
    """Whether an unread record may make its commit a candidate of ``select`` (``commits``:
    the records of its step that did read, by digest): an evaluation unless the commit's
    verdict read as failed; a verdict only if the commit has a score (its evaluation read
    with ``select.metric``; an unread one stops the choice itself)."""
    kinds = commits.get(record.digest, {})
    if record.kind == "evaluation":
        return kinds.get("validation", {}).get("ok") is not False
    value = (kinds.get("evaluation", {}).get("metrics") or {}).get(select.metric)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _scored_tiers(
    stores: Sequence[Store],
    run: str,
    step: int,
    tiers: list[int],
    values: dict[str, float],
    mode: str,
    known: Mapping[tuple[int, int], str],
) -> tuple[list[tuple[float, int, frozenset[str]]], str | None]:
    """``(score, tier index, the commits accepted there)`` for each tier of ``step`` to try,
    and why none is. ``values``: the score of each evaluated commit of the step. A tier is
    ranked by the evaluation of the commit it holds, never by another commit of the step:
    a step committed twice (the first commit evaluated 0.1, the one there now 0.9) ranks at
    0.9 where the new commit is. With one evaluated commit, the tiers ``_on_this_commit``
    keeps; with several every tier is read, and one that does not read is ranked at the
    best score and accepts only the commits that have it (restore passes it over if it
    then holds another)."""
    if len(values) == 1:
        [(only, value)] = values.items()
        kept, stale = _on_this_commit(stores, run, step, tiers, {only}, "evaluated", known)
        return [(value, index, frozenset({only})) for index in kept], stale
    top = min(values.values()) if mode == "min" else max(values.values())
    ranked: list[tuple[float, int, frozenset[str]]] = []
    other: str | None = None
    for index in tiers:
        held_there = _digest_in(stores, run, step, index, known)
        if held_there is None:
            ranked.append((top, index, frozenset(d for d, v in values.items() if v == top)))
        elif held_there in values:
            ranked.append((values[held_there], index, frozenset({held_there})))
        elif other is None:
            other = held_there
    return (ranked, None) if ranked or other is None else ([], _stale("evaluated", set(values), other))


def _by_alias(
    stores: Sequence[Store],
    run: str,
    select: Alias,
    held: dict[int, list[int]],
    registry: Store,
    known: Mapping[tuple[int, int], str],
) -> Choice:
    aliases = alias_records.read_aliases(registry, select.model)
    pairs: list[tuple[int, int]] = []
    passed: list[tuple[int, str]] = []
    commits: dict[tuple[int, int], frozenset[str]] = {}
    seen: set[tuple[int, str]] = set()  # (step, digest): two aliases may name two commits of one step
    for alias in ALIAS_CHAIN[select.alias]:
        if alias not in aliases:
            continue
        try:
            version = alias_records.read_version(registry, select.model, aliases[alias])
        except RegistryError as e:
            passed.append((-1, f"{select.model}@{alias}: {e}"))
            continue
        v_run, step, digest = version.get("run"), version.get("step"), version.get("manifest_digest")
        name = f"{select.model}@{alias} (v{aliases[alias]})"
        if v_run != run or not isinstance(step, int):
            elsewhere = f"{name} was published from run {v_run!r}, not {run!r}"
            passed.append((step if isinstance(step, int) else -1, elsewhere))
            continue
        if (step, str(digest)) in seen:
            continue
        seen.add((step, str(digest)))
        if step not in held:
            passed.append((step, f"{name}: step {step} is in no tier any more"))
            continue
        published = f"{name} was published from"
        untried = [i for i in held[step] if (step, i) not in commits]
        tiers, stale = _on_this_commit(stores, run, step, untried, {str(digest)}, published, known, every=True)
        if stale:
            passed.append((step, stale))
            continue
        pairs += [(step, i) for i in tiers]
        commits.update({(step, i): frozenset({str(digest)}) for i in tiers})
    if not aliases:
        passed.append((-1, f"model {select.model!r} has no aliases in {registry.url}"))
    return Choice(describe(select), pairs, passed, commits=commits)


def failed_steps(passed_over: list[tuple[int, str]]) -> set[int]:
    """The passed-over steps whose validation verdict proved damage: a save may replace
    them (the commit verifies them in full first, as for a step restore rejected)."""
    return {step for step, why in passed_over if why.startswith(FAILED)}
