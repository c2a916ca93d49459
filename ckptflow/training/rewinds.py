"""Training on from an older step than the run's newest whole checkpoint: say so at once.

A commit is create-only and a step is committed once, so a job restored to step N (``step=N``,
or a selector such as "validated" that passed over newer steps) whose saves reach a step the
run already holds whole has that save refused with ``CheckpointExistsError``, after the work
since N was done. Steps the restore skipped as damaged, or that failed validation, are not
among them: a save replaces those. The warning comes when the restore ends, while the job can
still change course (a new run name, or expiring the newer steps first).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ckptflow.catalog import listing
from ckptflow.store.base import Store
from ckptflow.training.restore import RestoreResult

log = logging.getLogger("ckptflow")


def warn_of_newer_steps(
    store: Store, run: str, result: RestoreResult, replaceable: Collection[int], *, rank: int
) -> list[int]:
    """The steps after the one ``result`` restored that ``run`` holds committed in ``store``
    and a save may not replace, warned of on rank 0; one listing from that step on, no record
    read. "latest" leaves no whole step newer (it tried each, newest first): no listing."""
    if result.select == "latest" or rank != 0:
        return []
    step = result.step
    after = listing.listing(store, run, from_steps={run: step + 1}, manifests_only=True)
    newer = [s.step for s in after if isinstance(s, listing.StepListing) and s.committed and s.step > step]
    kept = [s for s in newer if s not in replaceable]
    if kept:
        shown = ("steps " if len(kept) > 1 else "step ") + ", ".join(map(str, kept[:5]))
        shown += f" and {len(kept) - 5} more" if len(kept) > 5 else ""
        log.warning(
            "run %r resumed from step %d, but it holds newer checkpoints (%s): a save of any of those steps "
            "will be refused (CheckpointExistsError), after the work up to it; to train on from step %d, save "
            "under a new run name, or expire the newer steps first (ckptflow.lifecycle.expire)",
            run, step, shown, step,
        )  # fmt: skip
    return kept
