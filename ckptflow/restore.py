"""Restore: the newest checkpoint that is whole, loaded on every rank, or nothing at all.

Candidates are tried newest first. Only proof of damage moves a restore to an older
checkpoint: a hash mismatch, broken framing, a malformed or missing record, a missing
chunk. A store that could not be read (an S3 outage that outlasted the retries, a
denied read, an object in a cold storage class, a symbolic link the local backend will
not follow) proves nothing about the checkpoint, so restore stops and raises rather
than silently resuming from an older step; a job that catches
``NoValidCheckpointError`` to start from scratch never sees those.

Every rank verifies every chunk it needs before any tensor in ``state`` is written, and
the ranks agree on each verdict, so all of them load the same step or none does. A
restore that does not succeed leaves ``state`` as it was, fresh optimizers included.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptflow.catalog import read_manifest, read_rank_record
from ckptflow.dcp_io import CheckpointReader, Progress
from ckptflow.distributed import Group
from ckptflow.errors import ColdObjectError, NoValidCheckpointError, StoreUnavailableError
from ckptflow.failures import Failure, failure_of
from ckptflow.manifest import Manifest, RankRecord
from ckptflow.state import FreshOptimizers, flatten, load_state_dicts, restore_rng, to_state_dicts, unflatten
from ckptflow.tiers import Tier, candidates

log = logging.getLogger("ckptflow")


@dataclass(frozen=True)
class RestoreResult:
    step: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newest first
    metadata: dict = field(default_factory=dict)
    rng_restored: bool = False
    tier: str = ""  # URL of the store it was loaded from (the hot store, or an archive tier)
    hot_rejected: frozenset[int] = frozenset()  # hot steps skipped as damaged (a save may replace them)


def agree(group: Group, failure: Failure | None) -> Failure | None:
    """Every rank's verdict combined: any failure fails all ranks; any failure that is not
    damage makes the combined one not damage (one rank unable to read stops everyone)."""
    failures = [f for f in group.all_gather(failure) if f]
    if not failures:
        return None
    fatal = [f for f in failures if not f.damage]
    chosen = fatal or failures
    message = "; ".join(dict.fromkeys(f.message for f in chosen))
    return Failure(message, damage=not fatal, cold=any(f.cold for f in fatal))


class Restore:
    """One restore of ``run`` into ``state`` across ``tiers`` (hot first)."""

    def __init__(
        self,
        tiers: list[Tier],
        run: str,
        group: Group,
        pool: ThreadPoolExecutor,
        progress: Progress | None,
        restore_rng: bool,
    ):
        self.tiers, self.run, self.group, self.pool = tiers, run, group, pool
        self.progress, self.restore_rng = progress, restore_rng

    def __call__(self, state: MutableMapping[str, Any], step: int | None) -> RestoreResult:
        pairs, error = self.group.broadcast(self._candidates(step) if self.group.rank == 0 else None)
        if error is not None:
            raise error
        fresh = FreshOptimizers(state)
        self._optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        try:
            return self._first_loadable(state, step, pairs)
        except BaseException:
            fresh.reset()  # nothing was loaded: the state is as it was
            raise

    def _candidates(self, step: int | None) -> tuple[list[tuple[int, int]] | None, BaseException | None]:
        try:
            return candidates(self.tiers, self.run, step), None
        except Exception as e:  # every rank raises it, not only rank 0 (the others would hang)
            return None, e

    def _first_loadable(
        self, state: MutableMapping[str, Any], step: int | None, pairs: list[tuple[int, int]]
    ) -> RestoreResult:
        _, live = flatten(to_state_dicts(state))
        skipped: list[tuple[int, str]] = []
        hot_rejected: set[int] = set()
        for cand, index in pairs:
            tier = self.tiers[index]
            failure, loaded = self._try_load(cand, live, tier)
            if failure is None:
                assert loaded is not None
                manifest, record, tensors = loaded
                load_state_dicts(state, unflatten(record.state, tensors))
                rng_ok = bool(self.restore_rng and record.rng and record.rank == self.group.rank)
                if rng_ok:
                    restore_rng(record.rng)  # type: ignore[arg-type]
                return RestoreResult(cand, skipped, dict(manifest.metadata), rng_ok, tier.url, frozenset(hot_rejected))
            where = f"run {self.run!r} step {cand} in {tier.url}"
            if not failure.damage:
                error = ColdObjectError if failure.cold else StoreUnavailableError
                raise error(
                    f"could not read {where}, so restore stopped rather than fall back to an older checkpoint "
                    f"(nothing shows that this one is damaged): {failure.message}. "
                    + (
                        f"Thaw it (`ckptflow thaw {tier.url} --run {self.run} --step {cand}`) and restore again"
                        if failure.cold
                        else "Fix access to the store and restore again"
                    )
                )
            reason = f"{tier.url}: {failure.message}" if len(self.tiers) > 1 else failure.message
            if index == 0:
                hot_rejected.add(cand)
            log.warning("skipping checkpoint %s step %d: %s", self.run, cand, reason)
            skipped.append((cand, reason))
        where = f"run {self.run!r} in {' or '.join(t.url for t in self.tiers)}"
        if step is not None:
            reasons = "; ".join(r for _, r in skipped)
            raise NoValidCheckpointError(f"checkpoint step {step} of {where} cannot be restored: {reasons}", skipped)
        detail = "; ".join(f"step {s}: {r}" for s, r in skipped) or "no checkpoints at all"
        raise NoValidCheckpointError(f"no valid checkpoint for {where} ({detail})", skipped)

    def _try_load(
        self, step: int, live: dict[str, torch.Tensor], tier: Tier
    ) -> tuple[Failure | None, tuple[Manifest, RankRecord, dict[str, torch.Tensor]] | None]:
        """(the agreed failure, or None and what was loaded)."""
        local: Failure | None = None
        try:
            manifest = read_manifest(tier.store, self.run, step)
            rank = self.group.rank if self.group.rank < manifest.world_size else 0
            record = read_rank_record(tier.store, manifest, rank)
            targets = _targets(live, self._optimizers, manifest)
            local = _mismatch(targets, manifest)
        except Exception as e:
            local = failure_of(e)
        agreed = agree(self.group, local)
        if agreed is not None:
            return agreed, None
        reader = CheckpointReader(tier.chunks, manifest, self.pool, self.progress, agree=lambda f: agree(self.group, f))
        try:
            dcp.load(targets, storage_reader=reader, process_group=self.group.pg, no_dist=not self.group.active)
            local = None
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            local = failure_of(e)
        agreed = agree(self.group, local)
        return (agreed, None) if agreed else (None, (manifest, record, targets))


def _targets(live: dict[str, torch.Tensor], optimizers: list[str], manifest: Manifest) -> dict[str, torch.Tensor]:
    """The live tensors to load into. An optimizer saved before its first step has no
    state tensors in the checkpoint, and loading it makes the live one fresh again: the
    live state tensors are then not targets."""
    targets = dict(live)
    for prefix in (f"{name}.state." for name in optimizers):
        if not any(name.startswith(prefix) for name in manifest.dcp.tensors):
            targets = {k: v for k, v in targets.items() if not k.startswith(prefix)}
    return targets


def _mismatch(live: dict[str, torch.Tensor], manifest: Manifest) -> Failure | None:
    missing = set(live) - set(manifest.dcp.tensors)
    extra = set(manifest.dcp.tensors) - set(live)
    if not missing and not extra:
        return None
    return Failure(
        f"state does not match the checkpoint (missing from checkpoint: {sorted(missing)[:5]}, "
        f"not in current state: {sorted(extra)[:5]})",
        damage=True,
    )
