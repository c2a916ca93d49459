"""What a save cost, as its manifest records it (the ``save_cost`` field).

The checkpoint-interval advisor (``ckptflow.policy.interval``, ``ckptflow.reports.advice``)
needs the measured cost of a save and the training step time; recording them with every
commit means they are read from the store, never asked of the user. The record is
advisory: one that is absent (a manifest written before it existed) or malformed reads as
``None`` and never makes a checkpoint unreadable, since restore does not depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "save_cost"


@dataclass(frozen=True, kw_only=True)
class SaveCost:
    """Seconds measured by the coordinator rank's ``Checkpointer.save``.

    ``blocked_s``: how long the training loop was held by the call (for an async save the
    copy to host memory, plus any wait for the previous save still in flight).
    ``duration_s``: from the call to the commit (the whole save, background part included).
    ``step_time_s``: training time per step between the previous save (or restore)
    returning and this save being called, over ``steps_since`` steps; None for the first
    save of a process, which has nothing to measure from.
    """

    blocked_s: float
    duration_s: float
    step_time_s: float | None = None
    steps_since: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "blocked_s": round(self.blocked_s, 6),
            "duration_s": round(self.duration_s, 6),
            "step_time_s": None if self.step_time_s is None else round(self.step_time_s, 9),
            "steps_since": self.steps_since,
        }

    @classmethod
    def from_json(cls, doc: Any) -> SaveCost | None:
        """The record, or None for one that is absent or malformed (advisory: see the module)."""
        if not isinstance(doc, Mapping):
            return None
        blocked, duration = doc.get("blocked_s"), doc.get("duration_s")
        step_time, steps = doc.get("step_time_s"), doc.get("steps_since")
        if not isinstance(blocked, (int, float)) or not isinstance(duration, (int, float)):
            return None
        if not (_seconds(blocked) and _seconds(duration)):
            return None
        if step_time is not None and not _seconds(step_time):
            return None
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            return None
        return cls(
            blocked_s=float(blocked),
            duration_s=float(duration),
            step_time_s=None if step_time is None else float(step_time),
            steps_since=steps,
        )


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
