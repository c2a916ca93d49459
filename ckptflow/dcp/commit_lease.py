"""The coordinator's save lease, held from planning until its manifest is committed.

A lease held only while chunks are written leaves a gap: between the last rank record
and the commit, the save's chunks and rank records are referenced by nothing, and a GC
that runs then (grace shorter than the gap, a coordinator stalled in between) sweeps
them; the commit would then name chunks that are gone. So the coordinator takes its
lease in ``prepare_global_plan``, which DCP calls before it hands any rank its plan, so
before any rank writes, and keeps it through ``finish``: GC waits for (or skips past)
every live lease, so no sweep runs while any rank of the save writes or the commit is
pending. The plans it hands out say so (``COVERED``), and the other ranks take no lease of
their own: one would wait for a GC that took its lock since, which waits for the
coordinator's lease in turn, until it gives up. If the lease was lost meanwhile (not
renewed for half of ``DEAD_AFTER``: a GC may have judged the save dead and swept), the
commit is refused and nothing is committed.

A process stopped (SIGSTOP, a cgroup freezer, a debugger) between that check and the manifest's put
is seen after it: the lease was lost meanwhile, so a GC may have swept what the manifest
names before it was there to mark. Once no GC sweeps (a fresh lease), what it names is
looked for, and if any of it is gone, the manifest goes to quarantine and the save fails
(``confirm_commit``).

``finish`` releases it however it ends, and ``write_data`` when it fails. DCP calls no
writer method on the coordinator when another rank fails, so the caller releases the
lease when the save ends either way (``release``; the Checkpointer does, and code that
calls ``dcp.save`` itself must: docs/training.md). The release is the last thing a save
writes, after its manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

from torch.distributed.checkpoint.planner import SavePlan

from ckptflow.catalog.commit import confirm_commit
from ckptflow.chunks import leases
from ckptflow.chunks.leases import Heartbeat, save_lease
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

log = logging.getLogger("ckptflow")


# a plan's ``storage_data``: its save's coordinator held the lease before handing it out
COVERED = "ckptflow: written under the coordinator's save lease"


class CommitLease:
    """One save's lease on ``store``: ``hold`` it until ``release``; ``chunk_phase`` yields
    the held one, none where the coordinator holds it, or one for the chunk phase alone."""

    def __init__(self, store: Store, what: str):
        self.store, self.what = store, what
        self._stack: ExitStack | None = None
        self._held: Heartbeat | None = None
        self._lock = threading.Lock()

    def hold(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Take the lease (waiting out a live GC) and keep it until ``release``; ``plans``,
        each marked for its rank's ``chunk_phase`` as written under it (``COVERED``)."""
        with self._lock:
            if self._held is None:
                stack = ExitStack()
                self._held = stack.enter_context(save_lease(self.store))
                self._stack = stack
        return [dataclasses.replace(plan, storage_data=COVERED) for plan in plans]

    @contextmanager
    def chunk_phase(self, plan: SavePlan) -> Iterator[Heartbeat | None]:
        """The held lease; none on a rank whose ``plan`` its coordinator marked as held (a GC
        that took its lock since waits for the coordinator's lease, which it could never see
        end while this rank waited for that GC: both would wait until the GC gives up); else
        one of its own for the chunk phase (a planner that dropped the mark)."""
        if self._held is not None:
            yield self._held
        elif plan.storage_data == COVERED:
            yield None
        else:
            with save_lease(self.store) as beat:
                yield beat

    def check_held(self) -> None:
        """Before the commit: refused unless the lease is held and was never lost (a commit
        then is safe from GC)."""
        if self._held is None or self._held.lost:
            state = (
                "was not held"
                if self._held is None
                else f"was lost (deleted, or unrenewed for over {leases.DEAD_AFTER / 2:.0f} s: "
                "the store did not answer)"
            )
            raise StoreUnavailableError(
                f"the save lease of {self.what} in {self.store.url} {state} before its commit, so a GC may have "
                "swept its chunks or rank records meanwhile; nothing was committed: save again"
            )

    def confirm_commit(self, manifest: Manifest, blob: bytes, pool: ThreadPoolExecutor) -> None:
        """After the commit of ``manifest`` (sealed as ``blob``): if the lease was lost since
        ``check_held`` (the process stalled between the check and the put), what the
        manifest names is looked for (``catalog.commit.confirm_commit``)."""
        if self._held is None or self._held.lost:
            confirm_commit(self.store, manifest, blob, lease=f"the save lease of {self.what}", again="save", pool=pool)

    def release(self) -> None:
        """Give the lease back (idempotent; from any thread). A store error is logged, not
        raised: after a commit the save stands, after a failure that failure is the one to
        report, and a lease left behind holds GC only until it is judged dead."""
        with self._lock:
            stack, self._stack, self._held = self._stack, None, None
        if stack is None:
            return
        try:
            stack.close()
        except (CkptflowError, OSError) as e:
            log.warning("could not give back the save lease of %s in %s (%s); GC takes it for dead %.0f s after "
                        "its last renewal", self.what, self.store.url, e, leases.DEAD_AFTER)  # fmt: skip
