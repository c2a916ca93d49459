"""A commit's scores: the one rule ``Best``, the inventory, retention's best-K and promotion rank by.

A commit can carry a metric three ways: what its trainer recorded at save (the manifest's
metadata), what its trainer reported after the commit (the ``trainer`` lifecycle record: a
Lightning validation at that step) and its evaluation (the ``evaluation`` record). Readers
used to take different ones: ``Best`` the evaluation only, the inventory, retention and
promotion all three, so before any evaluation ran retention kept steps by the trainer's
score while ``restore(select="best")`` found no checkpoint with a score.

Per metric, the evaluation's value wins, then the trainer record's, then the metadata's.
The evaluation wins because it is the project's own measurement: the evaluator chosen for
the run, the same for every step it scores, with its improvement over the previous one
recorded beside it (without an evaluator it is the trainer's own figures, taken once).
What the trainer reported stands in for a commit not evaluated yet, or for a metric its
evaluation did not produce; a report after the commit is newer than the one at save.
Only finite numbers count (not booleans, not NaN): a metric that is none of them is no score.

Ranking compares figures on one scale only (``one_scale``). The trainer's figures (its
metadata, its trainer record, an evaluation made without an evaluator from them) are one
scale; each evaluator's are another: an evaluation loss and a training loss are not
comparable, nor two evaluators' figures (``ckptflow.lifecycle.evaluate`` compares an
improvement only with the same evaluator's). Until every candidate is evaluated, "the
evaluation wins" made ``Best`` rank one commit's evaluation against another's training
loss. Now, where an evaluator scored any candidate, they are ranked by that evaluator's
figures, the others left out (and said); the trainer's figures rank only where no
evaluator scored any. An unevaluated commit is not best until it is evaluated, rather
than best by another scale.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

# the lifecycle records whose ``metrics`` score a commit, the weaker first
SOURCES = ("trainer", "evaluation")
TRAINER = "the trainer's figures"  # the scale of what the trainer recorded or reported


def is_score(value: Any) -> bool:
    """A finite number that is not a bool (``True`` is 1 in Python)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite(values: Mapping[str, Any]) -> dict[str, float]:
    """The metrics of ``values`` that are scores (``is_score``), as they are."""
    return {str(k): v for k, v in values.items() if is_score(v)}


def scores(metadata: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Every metric of one commit by the rule: ``metadata`` (its manifest's) overridden by
    the ``metrics`` of its ``trainer`` record, then of its ``evaluation`` record (``records``:
    its lifecycle records by kind)."""
    out = finite(metadata)
    for kind in SOURCES:
        out.update(finite((records.get(kind) or {}).get("metrics") or {}))
    return out


def scales(metadata: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per metric, the commit's figure on each scale it has (``one_scale``): the trainer's
    (by ``scores``'s order among its sources) and its evaluator's, if one evaluated it."""
    evaluation = records.get("evaluation") or {}
    by = (
        TRAINER
        if evaluation.get("source") == "trainer"
        else f"{evaluation.get('evaluator') or 'its evaluator'}'s figures"
    )
    trainer = scores(metadata, {k: v for k, v in records.items() if k != "evaluation" or by == TRAINER})
    out = {metric: {TRAINER: value} for metric, value in trainer.items()}
    if by != TRAINER:
        for metric, value in finite(evaluation.get("metrics") or {}).items():
            out.setdefault(metric, {})[by] = value
    return out


def held_figures(
    metadata: Mapping[str, Any], records: Mapping[str, Mapping[str, Any]], metric: str
) -> dict[str, float] | None:
    """The figures of ``metric`` by scale (``scales``) a commit a tier holds brings to choosing
    the scale (``scale_of``), from its own manifest ``metadata`` and lifecycle ``records``;
    None if its validation failed (it may not rank). ``Best`` and promotion count each commit
    so, an earlier commit of a step only the archive holds too: one rule, one scale."""
    if (records.get("validation") or {}).get("ok") is False:
        return None
    return scales(metadata, records).get(metric) or {}


def no_score(metric: str) -> str:
    """Why a commit with no figure of ``metric`` on any scale is not ranked."""
    return f"no score of {metric!r} (evaluated, or reported by its trainer)"


def scale_of(figures: Mapping[K, Mapping[str, float]]) -> str:
    """The scale candidates are ranked on (``figures``: each one's figures of one metric by
    scale, from ``scales``): the evaluator's that scored the most of them (a tie: the first
    by name, so every reader takes the same), else the trainer's. Every commit that may rank
    counts, whether or not the reader may pick it: a tier holds it and its validation did not
    fail (``Best``; promotion, which picks a validated one only, counts those not validated
    yet too), so ``Best`` and promotion rank one run on the same scale."""
    counts = Counter(scale for by in figures.values() for scale in by if scale != TRAINER)
    return min(counts, key=lambda scale: (-counts[scale], scale)) if counts else TRAINER


def one_scale(
    figures: Mapping[K, Mapping[str, float]], *, scale: str | None = None
) -> tuple[dict[K, float], dict[K, str]]:
    """The candidates ranked (``figures``, as ``scale_of`` takes them) on the one scale they
    share, with their figure on it; and why each other is left out. ``scale``: the one
    ``scale_of`` chose among some of them (``Best``: the commits the tiers hold, not a record
    of a commit replaced since); None: among all."""
    chosen = scale_of(figures) if scale is None else scale
    ranked = {key: by[chosen] for key, by in figures.items() if chosen in by}
    left_out = {
        key: f"scored on {' and '.join(sorted(by))} only, not on {chosen}, which the others are ranked on"
        for key, by in figures.items()
        if by and chosen not in by
    }
    return ranked, left_out
