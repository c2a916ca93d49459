"""``Best(metric, mode)``: the commits that have a score of ``metric``, best first.

A commit's score is the one the inventory, retention's best-K and promotion rank by
(``ckptflow.policy.scores``): its evaluation's, else what its trainer reported after the
commit (its ``trainer`` record), else at save (its manifest's metadata); the commits are
ranked on one scale (``scores.one_scale``: an evaluator's where one scored any of them,
the others passed over, saying so). ``Best`` read the
evaluation only, so before any evaluation ran retention kept the steps the trainer scored
best while ``restore(select="best")`` found no checkpoint with a score.

The metadata of the commits the tiers hold is read through each tier's manifest index
(``catalog.summaries``: one listing and one read per tier once the index knows them) unless
the caller knows it (the inventory read it); a tier holding none of the candidate steps is
not read again. Every other tier's index is needed, even where the hot tier holds each step
the archive holds: the archive may hold an earlier commit of the step (committed again in
the hot tier since), ranked by its own metadata, which only that tier's index tells. That
also says which commit each tier holds, so no manifest is read again to check that a score
is about the commit there now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.choice import NEWER_COMMIT, Choice, digest_in, failed_now, on_this_commit, stale, stops_at
from ckptflow.catalog.listing import Problem
from ckptflow.catalog.selectors import Best, describe
from ckptflow.catalog.verdicts import Unread
from ckptflow.format import layout as fmt
from ckptflow.policy.scores import held_figures, is_score, no_score, one_scale, scale_of, scores
from ckptflow.store.base import Store

Metadata = Mapping[str, Mapping[str, Any]]  # a commit's manifest metadata, by its digest


def held_metadata(
    stores: Sequence[Store], run: str, held: Mapping[int, list[int]]
) -> tuple[dict[str, Mapping[str, Any]], dict[tuple[int, int], str], list[Unread]]:
    """The metadata of each commit the tiers hold at the ``held`` steps (by digest), the
    commit each (step, tier index) holds, and the commit records that could not be read (an
    outage: their score is unknown), from each tier's manifest index."""
    metadata: dict[str, Mapping[str, Any]] = {}
    digests: dict[tuple[int, int], str] = {}
    unread: list[Unread] = []
    holding = {index for tiers in held.values() for index in tiers}
    for index, store in enumerate(stores):
        if index not in holding:  # a tier that holds none of the steps (nothing archived yet): its index says nothing
            continue
        for item in catalog.summaries(store.metadata_store(), run):  # its index stays readable: not cold
            if item.step is None or index not in held.get(item.step, []):
                continue
            if isinstance(item, Problem):
                if item.kind == "newer":
                    digests[(item.step, index)] = NEWER_COMMIT
                elif item.could_not_read:
                    where = f"{store.url}/{fmt.manifest_key(run, item.step)} ({item.message})"
                    unread.append(Unread(item.step, "", "commit", where))
                continue
            metadata[item.digest] = item.metadata
            digests[(item.step, index)] = item.digest
    return metadata, digests, unread


def choose_best(
    stores: Sequence[Store],
    run: str,
    select: Best,
    held: dict[int, list[int]],
    by_step: dict[int, dict[str, dict]],
    known: Mapping[tuple[int, int], str],
    blocked: Mapping[int, list[Unread]],
    metadata: Metadata | None = None,
) -> Choice:
    """Best first (ties: newer first); a commit that failed validation is passed over. A step
    with an unread record (``blocked``) may be the best or a failed one, so no choice is made
    then (``Choice.stop``); unless the record cannot make its commit a candidate nor change
    its score (``_may_rank``). ``metadata``: each commit's manifest metadata by digest where
    the caller knows it; else it is read (``held_metadata``)."""
    every = {step: list(records) for step, records in blocked.items()}
    if metadata is None:
        metadata, digests, unread = held_metadata(stores, run, held)
        known = {**digests, **known}
        for record in unread:
            every.setdefault(record.step, []).append(record)
    ranking = {
        step: [u for u in unread if _may_rank(u, by_step.get(step, {}), metadata, select)]
        for step, unread in every.items()
    }
    for step in sorted(ranking, reverse=True):
        if stop := stops_at(stores, run, step, held[step], ranking, known):
            return Choice(describe(select), [], stop=stop)
    figures: dict[tuple[int, str], Mapping[str, float]] = {}  # (step, digest): its figures by scale
    holders: set[tuple[int, str]] = set()  # the commits a tier may hold: they choose the scale
    for step in held:
        recorded = by_step.get(step, {})
        holding = [known.get((step, i), NEWER_COMMIT) for i in held[step]]
        there = set(holding) - {NEWER_COMMIT}
        unknown = NEWER_COMMIT in holding  # a tier whose commit is not known may hold any recorded one
        for digest in set(recorded) | there:
            by = held_figures(metadata.get(digest, {}), recorded.get(digest, {}), select.metric)
            if by is not None:
                figures[(step, digest)] = by
            if unknown or digest in there:
                holders.add((step, digest))
    # an evaluation of a commit replaced since scores nothing a tier holds: counted, it chose
    # its evaluator's scale and every commit there was passed over as on another
    scale = scale_of({key: by for key, by in figures.items() if key in holders})
    on_scale, left_out = one_scale(figures, scale=scale)
    scored: list[tuple[float, int, int]] = []  # (the score of the commit a tier holds, step, tier index)
    passed: list[tuple[int, str]] = []
    commits: dict[tuple[int, int], frozenset[str]] = {}
    for step in sorted(held, reverse=True):
        values = {digest: float(value) for (at, digest), value in on_scale.items() if at == step}
        if not values:
            why = failed_now(stores, run, step, held[step], by_step, known) or next(
                (why for (at, _), why in left_out.items() if at == step), None
            )
            passed.append((step, why or no_score(select.metric)))
            continue
        tiers, why_not = _scored_tiers(stores, run, step, held[step], values, select.mode, known)
        if why_not:
            passed.append((step, why_not))
            continue
        for value, index, accepted in tiers:
            scored.append((value, step, index))
            commits[(step, index)] = accepted
    sign = 1 if select.mode == "min" else -1
    scored.sort(key=lambda t: (sign * t[0], -t[1]))  # stable: a step's tiers of one score keep their order
    pairs = [(step, index) for _, step, index in scored]
    return Choice(describe(select), pairs, passed, commits=commits)


def _may_rank(record: Unread, commits: Mapping[str, dict], metadata: Metadata, select: Best) -> bool:
    """Whether an unread record may make its commit a candidate of ``select`` or change its
    score (``commits``: the records of its step that did read, by digest): a commit record
    (its metadata may hold a score); an evaluation unless the commit's verdict read as
    failed; a trainer record unless that, or the commit's evaluation has the metric (which
    wins over it); a verdict only if the commit has a score (an unread record that could
    give it one stops the choice itself)."""
    kinds = commits.get(record.digest, {})
    failed = kinds.get("validation", {}).get("ok") is False
    if record.kind == "commit":
        return True
    if record.kind == "evaluation":
        return not failed
    if record.kind == "trainer":
        return not failed and not is_score((kinds.get("evaluation", {}).get("metrics") or {}).get(select.metric))
    return select.metric in scores(metadata.get(record.digest, {}), kinds)


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
    and why none is. ``values``: the score of each scored commit of the step. A tier is
    ranked by the score of the commit it holds, never by another commit of the step: a step
    committed twice (the first commit evaluated 0.1, the one there now 0.9) ranks at 0.9
    where the new commit is. With one scored commit, the tiers ``on_this_commit`` keeps;
    with several every tier is read, and one that does not read is ranked at the best
    score and accepts only the commits that have it (restore passes it over if it then
    holds another)."""
    if len(values) == 1:
        [(only, value)] = values.items()
        kept, why_not = on_this_commit(stores, run, step, tiers, {only}, "scored", known)
        return [(value, index, frozenset({only})) for index in kept], why_not
    top = min(values.values()) if mode == "min" else max(values.values())
    ranked: list[tuple[float, int, frozenset[str]]] = []
    other: str | None = None
    for index in tiers:
        held_there = digest_in(stores, run, step, index, known)
        if held_there is None:
            ranked.append((top, index, frozenset(d for d, v in values.items() if v == top)))
        elif held_there in values:
            ranked.append((values[held_there], index, frozenset({held_there})))
        elif other is None:
            other = held_there
    return (ranked, None) if ranked or other is None else ([], stale("scored", set(values), other))
