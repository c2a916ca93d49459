"""Times one save for the ``save_cost`` record its manifest carries (``ckptflow.format.save_cost``).

The commit is written by DCP's ``finish`` on the coordinator, which for an async save runs
in a background thread, while how long the caller was held is known only in the calling
thread once ``async_save`` returns. The clock joins the two: the caller marks the moment
it got control back, and the commit waits (briefly) for that mark.
"""

from __future__ import annotations

import threading
import time

from ckptflow.format.save_cost import SaveCost

RELEASE_WAIT_S = 10.0  # the caller marks its release right after async_save returns: far sooner than this


class SaveClock:
    def __init__(self, started: float, *, blocking: bool, step_time_s: float | None, steps_since: int | None):
        self.started = started  # time.perf_counter() when save() was called
        self.blocking = blocking
        self.step_time_s, self.steps_since = step_time_s, steps_since
        self._released = threading.Event()
        self._blocked_s: float | None = None

    @classmethod
    def since(cls, resumed: tuple[int, float] | None, step: int, *, blocking: bool) -> SaveClock:
        """Starts timing a save at ``step``; the step time is measured since training
        ``resumed`` (step, perf_counter) after the previous save or restore of this process
        (none before the first)."""
        now = time.perf_counter()
        since = step - resumed[0] if resumed else 0
        step_time = (now - resumed[1]) / since if resumed and since > 0 else None
        return cls(now, blocking=blocking, step_time_s=step_time, steps_since=since if step_time is not None else None)

    def release(self) -> float:
        """The caller has control back (an async save's copy is done): how long it was held."""
        self._blocked_s = time.perf_counter() - self.started
        self._released.set()
        return self._blocked_s

    def cost(self) -> SaveCost:
        """What the save cost, at its commit. A blocking save held the caller throughout."""
        duration = time.perf_counter() - self.started
        blocked = duration
        if not self.blocking and self._released.wait(RELEASE_WAIT_S) and self._blocked_s is not None:
            blocked = min(self._blocked_s, duration)
        return SaveCost(
            blocked_s=blocked, duration_s=duration, step_time_s=self.step_time_s, steps_since=self.steps_since
        )
