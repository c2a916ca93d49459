"""An adaptive save policy: the interval moves toward the model's optimum within an overhead bound.

CheckFreq (FAST '21) measures iteration time and checkpoint cost online and tunes the interval
so that checkpointing costs at most a bound of training time. ``AdaptivePolicy`` does that
with the interval model of ``ckptflow.policy.interval``: after each save the ``Checkpointer``
reports what it measured (``observe``: the blocked time and the step time); the next
interval is Daly's optimum for those costs and the MTBF, lengthened where needed so that
save stalls stay within ``max_overhead`` of training time. Every save carries the decision
that chose it (``decision``: the interval, the inputs and why), recorded in its manifest
(``save_decision``), so a later reader sees why step N was saved.

Pure: measurements arrive as arguments; no clock, no store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptflow.policy.interval import SCENARIOS, daly

SMOOTHING = 0.3  # weight of a new measurement in the running averages


@dataclass(kw_only=True)
class AdaptivePolicy:
    max_overhead: float = 0.02  # save stalls / training time, at most (CheckFreq bounds it at 3.5%)
    mtbf_s: float = SCENARIOS["unstable-network"][0]
    full_every: int = 10  # one full per this many saves
    initial_every: int = 100  # steps between saves until a save and a step time are measured
    min_every: int = 1
    max_every: int = 1_000_000
    _save_s: float | None = field(default=None, repr=False)
    _step_s: float | None = field(default=None, repr=False)
    _last: int | None = field(default=None, repr=False)
    _saves: int = field(default=0, repr=False)
    _every: int = field(default=0, repr=False)
    _why: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"max_overhead must be a fraction of training time in (0, 1), got {self.max_overhead!r}")
        if not 0 < self.mtbf_s < math.inf:  # an infinite one makes Daly's interval infinite: no step count
            raise ValueError(
                f"mtbf_s must be a positive, finite number of seconds, got {self.mtbf_s!r}; for a job that "
                "(almost) never fails give a long one (e.g. 30 days) and max_every bounds the interval"
            )
        if min(self.full_every, self.initial_every, self.min_every) < 1 or self.max_every < self.min_every:
            raise ValueError("full_every, initial_every and min_every must be at least 1, max_every >= min_every")
        self._every = min(max(self.initial_every, self.min_every), self.max_every)
        self._why = "nothing measured yet: the initial interval"

    @property
    def every(self) -> int:
        """Steps between saves now."""
        return self._every

    def kind_for(self, step: int) -> str | None:
        if self._last is None:
            return "full"
        if step - self._last < self._every:
            return None
        return "full" if self._saves % self.full_every == 0 else "incremental"

    def decision(self, step: int) -> dict[str, Any]:
        """Why ``step`` is saved: the interval in force and what it was chosen from (JSON)."""
        return {
            "policy": "adaptive",
            "step": step,
            "every_steps": self._every,
            "full_every": self.full_every,
            "why": self._why,
            "save_s": self._save_s,
            "step_time_s": self._step_s,
            "mtbf_s": self.mtbf_s,
            "max_overhead": self.max_overhead,
        }

    def observe(self, step: int, *, blocked_s: float, step_time_s: float | None) -> None:
        """A save at ``step`` held training ``blocked_s``; steps since the previous took
        ``step_time_s`` each (None: not measured). Sets the next interval."""
        self._last, self._saves = step, self._saves + 1
        self._save_s = _average(self._save_s, blocked_s)
        if step_time_s is not None and step_time_s > 0:
            self._step_s = _average(self._step_s, step_time_s)
        if self._step_s is None:
            return
        optimum = daly(self._save_s, self.mtbf_s)
        bound = self._save_s / self.max_overhead
        if bound > optimum:
            seconds = bound
            self._why = (
                f"overhead bound: {self._save_s:.3g} s held per save needs {bound:.3g} s between saves "
                f"for at most {100 * self.max_overhead:g}% (the optimum, {optimum:.3g} s, would exceed it)"
            )
        else:
            seconds = optimum
            self._why = f"Daly's optimum for {self._save_s:.3g} s per save and an MTBF of {self.mtbf_s:.3g} s"
        steps = math.ceil(seconds / self._step_s)
        self._every = min(max(steps, self.min_every), self.max_every)
        if self._every != steps:
            self._why += f"; clipped to [{self.min_every}, {self.max_every}] steps"


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
