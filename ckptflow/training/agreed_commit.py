"""Which commit of a step every rank restores: the same one, or none.

Each rank reads a step's commit record itself, and a step may be committed again between
two ranks' reads (a damaged step replaced by a save, in another job). Each rank would then
load its shards of another commit, every chunk whole and verified, and no rank would know:
the ranks compare the manifest digests they read before anything else is read.
"""

from __future__ import annotations

import logging

from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.catalog.tiers import Tier
from ckptflow.dcp.collectives import Group
from ckptflow.format.manifest import Manifest

COMMIT_READS = 3  # reads of a step's commit record until every rank holds the same commit
log = logging.getLogger("ckptflow")


class CommitsDifferError(Exception):
    """The ranks read different commits of a step, read after read. Private control flow, not
    in ``ckptflow.errors``: restore turns it into a failure that stops it (nothing shows damage)."""


def read_agreed_commit(group: Group, tier: Tier, run: str, step: int) -> Manifest | Exception:
    """``step``'s commit record in ``tier``, the same commit on every rank of ``group``, or why
    this rank could not read it (the caller judges that as any failed read). Ranks that read
    different commits all read again, up to ``COMMIT_READS`` times, then ``CommitsDifferError``
    on every rank alike (every rank compares the same digests)."""
    digests: list[str | None] = []
    for _ in range(COMMIT_READS):
        try:
            read: Manifest | Exception = read_manifest(tier.store, run, step)
        except Exception as e:
            read = e
        digests = group.all_gather(read.digest if isinstance(read, Manifest) else None)
        if len(set(digests) - {None}) <= 1:
            return read
        log.warning("ranks read different commits of run %s step %d in %s: reading it again", run, step, tier.url)
    held = ", ".join(f"rank {r}: {d[:12]}…" for r, d in enumerate(digests) if d)
    return CommitsDifferError(
        f"its ranks read different commits of it {COMMIT_READS} times in a row ({held}): it is being committed "
        "again while they read, and each rank would load its part of another one. Nothing was loaded"
    )
