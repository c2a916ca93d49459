"""What a restore recovers to: which checkpoints a selector accepts, in the order to try them.

"The most recent checkpoint might be corrupted; the most recent validated one is safer; the
best-performing one suits trying other approaches." A selector names that choice:

- ``"latest"`` (the default): every checkpoint, newest first (restore's own fallback past damage);
- ``"validated"``: only commits with a passing validation verdict on that exact manifest
  digest, newest first; a newer one that failed or has no verdict yet is passed over;
- ``Best(metric, mode)``: commits with a score of ``metric``, best first (ties: newer first);
  one that failed validation is passed over. The score is the one retention's best-K and the
  inventory rank by (``ckptflow.policy.scores``): the evaluation's, else what the trainer
  reported (``ckptflow.catalog.best``);
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
from typing import Any

from ckptflow.catalog import aliases as alias_records
from ckptflow.catalog.best import choose_best
from ckptflow.catalog.choice import FAILED, NOT_VALIDATED, Choice, failed_now, on_this_commit, stale, stops_at
from ckptflow.catalog.choice import NEWER_COMMIT as NEWER_COMMIT
from ckptflow.catalog.selectors import ALIAS_CHAIN, Alias, Best, Selector, describe
from ckptflow.catalog.selectors import check as check
from ckptflow.catalog.selectors import from_arguments as from_arguments
from ckptflow.catalog.selectors import parse as parse
from ckptflow.catalog.selectors import registry_store as registry_store
from ckptflow.catalog.verdicts import Unread, records_by_subject
from ckptflow.errors import RegistryError
from ckptflow.store.base import Store


def choose(
    stores: Sequence[Store],
    run: str,
    select: Selector,
    pairs: list[tuple[int, int]],
    registry: Store | None = None,
    *,
    digests: Mapping[tuple[int, int], str] | None = None,
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> Choice:
    """Order and filter ``pairs`` (restore's candidates across tiers, newest first) for
    ``select``. Verdicts, evaluations and trainer records are read from ``stores[0]`` (the
    hot store, where the lifecycle records them); a registry alias from ``registry``
    (default: the hot store). ``digests``: the commit each (step, tier index) of ``pairs``
    holds when the caller knows it (the inventory read them all), so no manifest is read to
    check that a verdict is about the commit there now; ``metadata``: for ``Best``, the
    manifest metadata of those commits by digest (else read: ``ckptflow.catalog.best``)."""
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
    needed = ("validation",) if select == "validated" else ("validation", "evaluation", "trainer")
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
    return choose_best(stores, run, select, held, by_step, known, blocked, metadata)


def not_the_commit_accepted(accepted: frozenset[str], current: str) -> str:
    """Why a step's commit read at restore is passed over: the selector accepted another."""
    return stale("the selector accepted", set(accepted), current) + "; committed again since, or not read then"


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
            on_this_commit(stores, run, step, held[step], ok, "validation passed on", known) if ok else ([], None)
        )
        if not tiers and (stop := stops_at(stores, run, step, held[step], blocked, known)):
            return Choice(label, pairs, passed, commits=commits, stop=stop)
        if not ok:
            passed.append((step, failed_now(stores, run, step, held[step], by_step, known) or NOT_VALIDATED))
            continue
        if stale:
            passed.append((step, stale))
            continue
        pairs += [(step, i) for i in tiers]
        commits.update({(step, i): frozenset(ok) for i in tiers})
    return Choice(label, pairs, passed, commits=commits)


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
        tiers, stale = on_this_commit(stores, run, step, untried, {str(digest)}, published, known, every=True)
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
