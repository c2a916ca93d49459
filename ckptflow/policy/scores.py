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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# the lifecycle records whose ``metrics`` score a commit, the weaker first
SOURCES = ("trainer", "evaluation")


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
