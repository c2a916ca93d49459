"""What every rank agrees on before a save writes anything: the state as a JSON
skeleton and tensors, the metadata checked, and the step the save is at (free, or
holding a manifest proved damaged; its base step; the attempt's id).

Split from ``ckptflow.training.checkpointer`` because these are the save's own
collectives, made before DCP's: any rank's refusal must be every rank's (a lone raise
would hang the others in the collectives that follow), so each function gathers or
broadcasts one answer, which every rank returns or raises together.
"""

from __future__ import annotations

import uuid
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog.commit import check_step
from ckptflow.dcp.collectives import Group
from ckptflow.errors import CkptflowError, UnsupportedStateError
from ckptflow.format.sealed import json_problem
from ckptflow.format.state_tree import flatten
from ckptflow.store import Store
from ckptflow.training.state import FreshOptimizers, to_state_dicts


def flatten_on_every_rank(
    state: MutableMapping[str, Any], metadata: dict | None, group: Group
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The state as a JSON skeleton and tensors, and the metadata checked, on every rank
    before anything is written (any rank's refusal is every rank's: a lone raise would
    hang the others in the collectives that follow). Any exception counts, not only ours:
    a ``state_dict()`` that raises on one rank (a data loader's) would otherwise leave the
    others waiting in this gather until the group's timeout (30 minutes by default)."""
    error: CkptflowError | None = None
    own: Exception | None = None
    try:
        problem = json_problem(metadata or {}, "metadata")
        if problem:
            raise UnsupportedStateError(f"{problem}; metadata is stored as JSON, so nothing was saved")
        fresh = FreshOptimizers(state)
        try:
            state_dicts = to_state_dicts(state)
            fresh.empty(state_dicts)
        finally:
            fresh.reset()  # a save never changes the state it saves
        skeleton, tensors = flatten(state_dicts, rank=group.rank)
    except CkptflowError as e:
        error = own = e
    except Exception as e:  # told to the others as text: it may not pickle
        own = e
        error = CkptflowError(
            f"rank {group.rank} could not take the state to save ({type(e).__name__}: {e}; its traceback is in "
            "that rank's log), so no rank saved anything: fix what that rank's state raised and save again"
        )
    errors = [e for e in group.all_gather(error) if e is not None]
    if errors:
        raise own or errors[0]
    return skeleton, tensors


def claim_step(
    store: Store,
    run: str,
    step: int,
    group: Group,
    pool: ThreadPoolExecutor,
    *,
    kind: str,
    superseded: set[int],
    last_commit: int | None,
) -> tuple[int | None, str, str | None]:
    """Rank 0 checks the step is free (or holds a manifest proved damaged, which the
    commit moves aside), finds the base step and names the attempt: (base step, save id,
    the digest of the manifest it replaces). Every rank gets the same answer or raises
    the same error (a lone raise would hang the others in DCP's collectives).
    ``superseded``: steps whose commit a restore rejected (a save may replace them);
    ``last_commit``: the newest step this process committed or restored.

    First every rank's ``step`` and ``kind`` are compared: rank 0 decides for its own step,
    and the commit is its own, so a rank a step ahead wrote its record under another step
    (the commit was damaged from the start: "rank record missing"), and one asked for an
    incremental save reused chunks under a commit called full."""
    asked = group.all_gather((step, kind))
    if len(set(asked)) > 1:
        each = ", ".join(f"rank {r}: step {s} ({k})" for r, (s, k) in enumerate(asked))
        raise CkptflowError(
            f"the ranks asked for different saves of run {run!r} ({each}), so nothing was written: every rank "
            "must call save() with the same step and kind"
        )

    def decide() -> tuple[int | None, str, str | None]:
        replaces = check_step(store, run, step, pool, rejected=step in superseded)
        base = newest_committed_before(store, run, step, superseded=superseded, last_commit=last_commit)
        return base, uuid.uuid4().hex, replaces

    return group.decided_on_rank_0(decide, f"check that step {step} of run {run!r} is free to save")


def newest_committed_before(
    store: Store, run: str, step: int, *, superseded: set[int], last_commit: int | None
) -> int | None:
    """The base of an incremental save: known in a training loop without listing the store
    (``last_commit``); else the newest committed step before ``step`` not ``superseded``."""
    if last_commit is not None and last_commit < step:
        return last_commit
    for older in reversed(catalog_listing.committed_steps(store, run)):
        if older < step and older not in superseded:
            return older
    return None
