"""The recovery record of a restore or load (``ckptflow.catalog.recovery_log``), written by rank 0
when it ends, loaded or not: what it loaded, or the error it raised with what it went past. A
``StateMismatchError`` of ``restore`` is the caller's side (the state passed, not the checkpoint),
so its record says the restore was rejected, and the recovery figures leave it out, unless it
fell back past damaged checkpoints first (a failed recovery with its fallback). ``load`` is
given no state, so it raises none: a tensor this machine cannot allocate is a
``HostMemoryError``, a failed recovery (the job did not recover here) with its fallback."""

from __future__ import annotations

import time

from ckptflow.catalog import recovery_log
from ckptflow.dcp.collectives import Group
from ckptflow.errors import CkptflowError, StateMismatchError
from ckptflow.store import Store
from ckptflow.training.restore import RestoreResult


def record_recovery(
    store: Store,
    run: str,
    group: Group,
    started: float,
    *,
    result: RestoreResult | None = None,
    error: CkptflowError | None = None,
    select: str = "latest",
) -> None:
    """Rank 0 of ``group`` records in ``store`` a restore or load of ``run`` begun at
    ``started``: what it loaded, or the error it raised (``ckptflow.reports.recoveries``)."""
    if group.rank == 0:
        # a fallback past damage first: the state may fit the newest, the damage stopped the recovery
        rejected = isinstance(error, StateMismatchError) and not error.skipped
        recovery_log.record(
            store,
            run,
            ok=result is not None,
            step=result.step if result else None,
            digest=result.digest if result else None,
            skipped=result.skipped if result else getattr(error, "skipped", []),
            tier=result.tier if result else None,
            duration_s=time.perf_counter() - started,
            error=None if result else str(error),
            select=result.select if result else select,
            passed_over=result.passed_over if result else getattr(error, "passed_over", []),
            rejected=recovery_log.REJECTED_STATE_MISMATCH if rejected else None,
        )
