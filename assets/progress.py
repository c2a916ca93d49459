"""Progress of a long library operation as lines in the Dagster run's log.

The library reports progress as a byte count per piece of work (``progress=`` of
``lifecycle.validate``, ``compress``, ``archive``, ``scrub``, ``gc``); the CLI turns it into
a tqdm bar. A Dagster run has no terminal: an operator watching a multi-GB validation or
archival in the UI saw nothing until the step ended. ``logged_progress`` turns the same
callback into a few ``context.log.info`` lines: how much is done (of the total, when
known), the percentage and the rate, and one final line with the exact byte count and
the time it took (``ProgressLog.seconds``, which the caller puts in the metadata). A phase
that begins partway through an operation (archival's re-read of its copy) has lines of its
own (``logged_phase``), so no percentage passes 100% or starts again unannounced.

Throttled, so a store-wide scrub does not flood the event log: a line once ``every_s``
seconds have passed since the last, or once another tenth of a known total is done, if
a tenth of ``every_s`` has passed (a checkpoint read in under a second logs only its final
line). Thread-safe: verification calls back from its reader threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

from dagster import AssetExecutionContext, OpExecutionContext

from ckptflow.reports.units import human_bytes, human_duration

EVERY_S = 10.0
MB = 1_000_000  # rates in decimal megabytes per second, as storage and network rates are quoted


def rate(n: int, seconds: float) -> float | None:
    """MB/s, None for an instant (no rate to speak of)."""
    return n / MB / seconds if seconds > 0 else None


class ProgressLog:
    """A library ``progress`` callback that writes throttled lines through ``log``."""

    def __init__(
        self,
        log: Callable[[str], None],
        what: str,
        *,
        total: int | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.what, self.total, self.every_s, self.clock = log, what, total, every_s, clock
        self.done = 0
        self.seconds = 0.0  # from creation to ``finish``
        self._lock = threading.Lock()
        self._start = self._last = clock()
        self._tenths = 0  # tenths of ``total`` done when the last line was written

    def __call__(self, n: int) -> None:
        with self._lock:  # one count and one line at a time, in order
            self.done += n
            now = self.clock()
            since = now - self._last
            # 9 at most: the final line reports the whole
            tenths = min(self.done * 10 // self.total, 9) if self.total else 0
            if since >= self.every_s or (tenths > self._tenths and since >= self.every_s / 10):
                self._tenths, self._last = tenths, now
                self.log(self._line(now))

    def _line(self, now: float) -> str:
        done = human_bytes(self.done)
        if self.total:
            done += f" of {human_bytes(self.total)} ({100 * self.done / self.total:.0f}%)"
        mbs = rate(self.done, now - self._start)
        return f"{self.what}: {done}" + ("" if mbs is None else f", {mbs:.1f} MB/s")

    def finish(self, *, ok: bool = True) -> None:
        """The final line: the exact byte count, the time taken and the rate; "stopped"
        when the operation raised (how far it got)."""
        with self._lock:
            self.seconds = self.clock() - self._start
            mbs = rate(self.done, self.seconds)
            self.log(
                f"{self.what}: {'finished' if ok else 'stopped'} after {human_bytes(self.done)} ({self.done} bytes) "
                f"in {human_duration(self.seconds)}" + ("" if mbs is None else f", {mbs:.1f} MB/s")
            )


class LaterPhase:
    """A library ``Phase`` (``verifying=`` of ``lifecycle.archive``): a phase that begins
    partway through an operation gets a ``ProgressLog`` of its own when it begins, with the
    total it is given, so its percentage and its time are its own. ``meter``: that log, or
    None while (or if) the phase has not begun."""

    def __init__(self, log: Callable[[str], None], what: str) -> None:
        self.log, self.what = log, what
        self.meter: ProgressLog | None = None

    def __call__(self, total: int) -> ProgressLog:
        self.meter = ProgressLog(self.log, self.what, total=total, every_s=EVERY_S)
        return self.meter

    def finish(self, *, ok: bool = True) -> None:
        if self.meter is not None:
            self.meter.finish(ok=ok)


Meter = TypeVar("Meter", ProgressLog, LaterPhase)


@contextmanager
def _finished(meter: Meter) -> Iterator[Meter]:
    """``meter``, and its final line when the block ends ("stopped" if it raised)."""
    try:
        yield meter
    except BaseException:
        meter.finish(ok=False)
        raise
    meter.finish()


def logged_progress(
    context: AssetExecutionContext | OpExecutionContext, what: str, *, total: int | None = None
) -> AbstractContextManager[ProgressLog]:
    """A ``ProgressLog`` writing to the run's log; its final line when the block ends."""
    return _finished(ProgressLog(context.log.info, what, total=total, every_s=EVERY_S))  # read now: tests set it to 0


def logged_phase(context: AssetExecutionContext | OpExecutionContext, what: str) -> AbstractContextManager[LaterPhase]:
    """A ``LaterPhase`` writing to the run's log; the phase's final line when the block ends
    (what follows the phase in the operation counts in its time)."""
    return _finished(LaterPhase(context.log.info, what))
