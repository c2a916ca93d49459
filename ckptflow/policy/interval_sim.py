"""A discrete-event simulation of checkpointed training under exponential failures.

It checks the closed form in ``ckptflow.policy.interval`` (tests and
``benchmarks/advisor_simulation.py``) without sharing its algebra: it draws failures and
plays each one out. Failures are memoryless, so the run splits into independent epochs,
each starting right after a completed restore at a checkpoint: training runs segments of
work plus save until the next failure, which loses the segment in progress; then restore
attempts run until one completes without a failure (a failure during a restore starts it
again). Seeded, so a given seed gives the same answer.
"""

from __future__ import annotations

import numpy as np


def simulate_waste(
    interval_s: float, *, save_s: float, mtbf_s: float, restore_s: float, failures: int = 40_000, seed: int = 0
) -> float:
    """The simulated fraction of wall time not spent on useful work, over ``failures`` epochs."""
    rng = np.random.default_rng(seed)
    segment = interval_s + save_s
    up = rng.exponential(mtbf_s, failures)  # time from the end of a restore to the next failure
    completed = np.floor(up / segment)  # segments saved before it
    useful = float(completed.sum()) * interval_s
    wall = float(up.sum())
    pending = np.ones(failures, dtype=bool)  # restores not completed yet
    while pending.any():
        attempt = rng.exponential(mtbf_s, int(pending.sum()))
        failed = attempt < restore_s
        wall += float(np.where(failed, attempt, restore_s).sum())
        pending[pending] = failed
    return 1.0 - useful / wall
