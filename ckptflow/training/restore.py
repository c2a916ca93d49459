"""Restore: the newest checkpoint that is whole, loaded on every rank, or nothing at all.

Candidates are tried newest first. Only proof of damage moves a restore to an older
checkpoint: a hash mismatch, broken framing, a malformed or missing record, a missing
chunk. A store that could not be read (an S3 outage that outlasted the retries, a
denied read, an object in a cold storage class, a symbolic link the local backend will
not follow) proves nothing about the checkpoint, and neither does a manifest a newer
ckptflow wrote (``NewerFormatError``), so restore stops and raises rather than silently
resuming from an older step; a job that catches
``NoValidCheckpointError`` to start from scratch never sees those.

Every rank verifies every chunk it needs before any tensor in ``state`` is written, and
the ranks agree on each verdict, so all of them load the same step or none does; and the
same commit of it (``agreed_commit``: a step may be committed again while they read). A
restore rejected there (damage anywhere, on any rank, an unreadable store, a state that
does not fit) leaves ``state`` as it was, fresh optimizers included. Only a failure
after that point, while verified chunks are read into place (an I/O error, a chunk
damaged in the moment between the passes), leaves it partly overwritten: that raises
``PartialRestoreError`` on every rank, never a silent fallback.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptflow.catalog import selection
from ckptflow.catalog.checkpoints import read_rank_record
from ckptflow.catalog.tiers import Tier, candidates
from ckptflow.chunks import lossy
from ckptflow.chunks.budget import DEFAULT_RESTORE_BUFFER, MemoryBudget
from ckptflow.dcp.allocation import empty_tensor
from ckptflow.dcp.collectives import Group
from ckptflow.dcp.failures import Failure, agree, failure_of
from ckptflow.dcp.reader import CheckpointReader
from ckptflow.dcp.regions import Seen
from ckptflow.dcp.writer import Progress
from ckptflow.errors import (
    ColdObjectError,
    HostMemoryError,
    LossyCopyError,
    NewerFormatError,
    NoValidCheckpointError,
    PartialRestoreError,
    StateMismatchError,
    StoreUnavailableError,
)
from ckptflow.format.manifest import Manifest, RankRecord
from ckptflow.format.state_tree import flatten, tensor_refs, unflatten
from ckptflow.training.agreed_commit import CommitsDifferError, read_agreed_commit
from ckptflow.training.matching import LoadPlan, entries, plan_load
from ckptflow.training.state import FreshOptimizers, check_rng, load_state_dicts, restore_rng, to_state_dicts

log = logging.getLogger("ckptflow")


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    step: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newest first
    metadata: dict = field(default_factory=dict)
    rng_restored: bool = False  # every RNG state the checkpoint holds for this rank was applied
    rng_skipped: list[str] = field(default_factory=list)  # the saved ones not applied (["cuda"]), the rest were
    tier: str = ""  # URL of the store it was loaded from (the hot store, or an archive tier)
    hot_rejected: frozenset[int] = frozenset()  # hot steps skipped as damaged (a save may replace them)
    missing_keys: list[str] = field(default_factory=list)  # strict=False: live, not in the checkpoint
    unexpected_keys: list[str] = field(default_factory=list)  # strict=False: in the checkpoint, not live
    lossy: dict | None = None  # a lossy archive copy was loaded (allow_lossy=True): what it lost
    not_restored: list[str] = field(default_factory=list)  # state entries a lossy copy lacks, left as they were
    digest: str = ""  # the manifest digest of exactly the commit that was loaded
    select: str = "latest"  # the selector that chose it (``ckptflow.catalog.selection.describe``)
    passed_over: list[tuple[int, str]] = field(default_factory=list)  # not what the selector accepts, and why
    warmup: Any = None  # restore(..., warmup=Warmup(...)): its WarmupReport (ckptflow.training.warmup)

    @property
    def fell_back(self) -> bool:
        """Whether a checkpoint the selector preferred was skipped as damaged."""
        return bool(self.skipped)


class Restore:
    """One restore of ``run`` into ``state`` across ``tiers`` (hot first). ``strict=False``
    loads what matches and reports the rest (``missing_keys``, ``unexpected_keys``)."""

    def __init__(
        self,
        tiers: list[Tier],
        run: str,
        group: Group,
        pool: ThreadPoolExecutor,
        progress: Progress | None,
        *,
        restore_rng: bool,
        strict: bool = True,
        allow_lossy: bool = False,
        buffer_bytes: int = DEFAULT_RESTORE_BUFFER,
        registry: Any = None,
        single_pass: bool = False,
    ):
        self.tiers, self.run, self.group, self.pool = tiers, run, group, pool
        self.buffer_bytes = buffer_bytes  # each candidate's read gets a budget of its own
        self.progress, self.restore_rng, self.strict, self.allow_lossy = progress, restore_rng, strict, allow_lossy
        self.registry = registry  # the store an ``Alias`` selector reads (None: the hot store)
        self.single_pass = single_pass  # verify while reading into place (``CheckpointReader``)
        self.loaded: Seen = {}  # the regions this rank loaded from the checkpoint restored (``ckptflow.dcp.regions``)

    def __call__(self, state: MutableMapping[str, Any], step: selection.Selector | None) -> RestoreResult:
        """Restore into the live objects of ``state``."""
        fresh = FreshOptimizers(state)
        optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        try:
            live_skeleton, live = flatten(to_state_dicts(state), rank=self.group.rank)

            def plan_for(manifest: Manifest, record: RankRecord, _tier: Tier) -> LoadPlan:
                return plan_load(
                    live_skeleton,
                    live,
                    record.state,
                    optimizers,
                    strict=self.strict,
                    dropped=lossy.dropped(manifest),
                    saved_shapes={fqn: t.size for fqn, t in manifest.dcp.tensors.items()},
                )

            found = self._search(step, plan_for)
            saved = entries(found.record.state)
            loaded = {e: unflatten(saved[e], found.plan.targets) for e in found.plan.entries}
            self._apply(state, loaded, found.step)
        except BaseException:
            fresh.reset()  # nothing was loaded: the state is as it was
            raise
        fresh.reset(loaded=found.plan.entries)  # an optimizer the checkpoint did not fill stays fresh
        return self._result(found)

    def _apply(self, state: MutableMapping[str, Any], loaded: dict[str, Any], step: int) -> None:
        """Hand the live objects what was read (``load_state_dicts``). The tensors are in
        place by now, so an object that refuses its state (a data loader built for another
        dataset) leaves ``state`` partly overwritten: every rank says so, as one."""
        error: str | None = None
        try:
            load_state_dicts(state, loaded, strict=self.strict)
        except Exception as e:
            error = f"rank {self.group.rank}: {type(e).__name__}: {e}"
        errors = [e for e in self.group.all_gather(error) if e]
        if errors:
            raise PartialRestoreError(
                f"restoring run {self.run!r} step {step} read every tensor into place, then handing the live "
                f"objects their saved state failed ({'; '.join(errors)}). `state` is now partly overwritten with "
                "this step's values: make the live objects accept the state they saved, then restore again, or "
                "rebuild the state before training on it"
            )

    def load(self, step: selection.Selector | None) -> tuple[RestoreResult, dict[str, Any]]:
        """A new state holding what was saved: full tensors (shards gathered) and the
        JSON values, for code that has no live objects to restore into (an integration
        handing a framework its checkpoint dict)."""

        def everything(manifest: Manifest, record: RankRecord, tier: Tier) -> LoadPlan:
            where = f"run {manifest.run!r} step {manifest.step}"
            names = sorted(set(tensor_refs(record.state)))
            targets = {n: empty_tensor(tier.store, manifest, n, where) for n in names}
            return LoadPlan(sorted(entries(record.state)), targets)

        found = self._search(step, everything, collective=False)
        return self._result(found), unflatten(found.record.state, found.plan.targets)

    def _result(self, found: Found) -> RestoreResult:
        record, manifest = found.record, found.manifest
        rng_skipped: list[str] | None = None  # None: no RNG state restored at all
        if self.restore_rng and record.rng and record.rank == self.group.rank:
            rng_skipped = restore_rng(record.rng, f"run {self.run!r} step {found.step} (rank {record.rank})")
        lost = dict(manifest.lossy) if manifest.lossy is not None else None
        if lost is not None:
            log.warning("restored a lossy copy of %s step %d: %s", self.run, found.step, lossy.describe(lost))
        return RestoreResult(
            step=found.step,
            skipped=found.skipped,
            metadata=dict(manifest.metadata),
            rng_restored=rng_skipped == [],
            rng_skipped=rng_skipped or [],
            tier=found.tier.url,
            hot_rejected=frozenset(found.hot_rejected),
            missing_keys=found.plan.missing_keys,
            unexpected_keys=found.plan.unexpected_keys,
            lossy=lost,
            not_restored=lossy.dropped(manifest),
            digest=manifest.digest,
            select=found.choice.label,
            passed_over=list(found.choice.passed_over),
        )

    def _choose(self, select: selection.Selector) -> selection.Choice:
        pairs = candidates(self.tiers, self.run, select if isinstance(select, int) else None)
        stores = [t.store for t in self.tiers]
        return selection.choose(stores, self.run, select, pairs, self.registry)

    def _search(self, select: selection.Selector | None, plan_for: PlanFor, *, collective: bool = True) -> Found:
        """The first candidate the selector accepts whose chunks all verify, loaded into its
        plan's targets; damage moves to the selector's next candidate, anything else raises."""
        select = "latest" if select is None else select
        choice = self.group.decided_on_rank_0(
            lambda: self._choose(select), f"choose the checkpoint of run {self.run!r} to restore"
        )
        pairs = choice.pairs
        skipped: list[tuple[int, str]] = []
        hot_rejected: set[int] = set()
        for cand, index in pairs:
            tier = self.tiers[index]
            accepted = choice.commits.get((cand, index))
            failure, loaded = self._try_load(cand, plan_for, tier, collective=collective, accepted=accepted)
            if failure is not None and failure.committed_again:  # not the commit the selector accepted
                choice = replace(choice, passed_over=[*choice.passed_over, (cand, failure.message)])
                continue
            if failure is None:
                assert loaded is not None
                manifest, record, plan = loaded
                return Found(
                    step=cand,
                    tier=tier,
                    manifest=manifest,
                    record=record,
                    plan=plan,
                    skipped=skipped,
                    hot_rejected=hot_rejected,
                    choice=choice,
                )
            where = f"run {self.run!r} step {cand} in {tier.url}"
            if failure.partial:  # no fallback: an older step would not overwrite all of it under strict=False
                when = (
                    "while reading its chunks into place and verifying them there (single_pass=True)"
                    if self.single_pass
                    else "after every chunk had verified, while reading them into place"
                )
                again = "without single_pass " if self.single_pass else ""
                raise PartialRestoreError(
                    f"restoring {where} failed {when}: {failure.message}. `state` is now partly overwritten with "
                    f"this step's values: restore again {again}(it verifies everything before writing and falls "
                    "back past damage) or rebuild the state before training on it"
                )
            if failure.mismatch:
                past = "; ".join(f"step {step}" for step, _ in skipped)
                damaged = f" (newer checkpoints were skipped as damaged first: {past})" if skipped else ""
                raise StateMismatchError(
                    f"{where}: {failure.message}{damaged}", skipped, passed_over=list(choice.passed_over)
                )
            if failure.newer:
                raise NewerFormatError(
                    f"restore of {where} stopped rather than fall back to an older checkpoint (nothing shows that "
                    f"this one is damaged): {failure.message}; to load an older step instead, name it (step=N)"
                )
            if failure.memory:
                raise HostMemoryError(
                    f"restore of {where} ran out of host memory, so it stopped rather than fall back to an older "
                    f"checkpoint (nothing shows that this one is damaged): {failure.message}",
                    skipped,
                    passed_over=list(choice.passed_over),
                )
            if not failure.damage:
                error = ColdObjectError if failure.cold else StoreUnavailableError
                raise error(
                    f"could not read {where}, so restore stopped rather than fall back to an older checkpoint "
                    f"(nothing shows that this one is damaged): {failure.message}. "
                    + (
                        f"Thaw it (`ckptflow thaw {tier.url} --run {self.run} --step {cand}`) and restore again"
                        if failure.cold
                        else "Fix access to the store and restore again"
                    ),
                    skipped=skipped,
                    passed_over=list(choice.passed_over),
                )
            reason = f"{tier.url}: {failure.message}" if len(self.tiers) > 1 else failure.message
            if index == 0:
                hot_rejected.add(cand)
            log.warning("skipping checkpoint %s step %d: %s", self.run, cand, reason)
            skipped.append((cand, reason))
            # a rejected try's errors hold its frames (and what they read) in reference cycles: return
            # that memory before the next candidate, since a restore pauses the collector (``collector``)
            gc.collect()
        where = f"run {self.run!r} in {' or '.join(t.url for t in self.tiers)}"
        if choice.stop is not None:  # what the selector accepts further on is not known
            raise StoreUnavailableError(
                f"restore of {where} ({choice.label!r}) stopped: {choice.stop}",
                skipped=skipped,
                passed_over=list(choice.passed_over),
            )
        if choice.exact:
            reasons = "; ".join(r for _, r in skipped)
            raise NoValidCheckpointError(f"checkpoint step {select} of {where} cannot be restored: {reasons}", skipped)
        detail = "; ".join(f"step {s}: {r}" for s, r in skipped) or "no checkpoints at all"
        if choice.label == "latest":
            raise NoValidCheckpointError(f"no valid checkpoint for {where} ({detail})", skipped)
        over = "; ".join(f"step {s}: {r}" if s >= 0 else r for s, r in choice.passed_over) or "none"
        raise NoValidCheckpointError(
            f"no checkpoint of {where} is both {choice.label!r} and whole (skipped as damaged: "
            f"{detail if skipped else 'none'}; not {choice.label!r}: {over}). Choose another selector "
            "(select='latest' restores the newest whole checkpoint) or validate/evaluate the checkpoints first",
            skipped,
            passed_over=list(choice.passed_over),
        )

    def _try_load(
        self, step: int, plan_for: PlanFor, tier: Tier, *, collective: bool, accepted: frozenset[str] | None
    ) -> tuple[Failure | None, tuple[Manifest, RankRecord, LoadPlan] | None]:
        """(the agreed failure, or None and what was loaded). The plan is made from the
        records before any chunk is read, so a mismatch costs no I/O and changes nothing.
        ``accepted``: the commits the selector accepted at ``step`` (None: any; a lossy
        copy made from one of them is one too); another one there now (committed again
        since, or not read when the selector looked) is ``Failure.committed_again``."""
        local: Failure | None = None
        read = read_agreed_commit(self.group, tier, self.run, step)
        try:
            if isinstance(read, Exception):  # judged as any other failure to read the commit
                raise read
            manifest = read
            if accepted is not None and not accepted & {manifest.digest, (manifest.lossy or {}).get("source_digest")}:
                raise _CommittedAgain(selection.not_the_commit_accepted(accepted, manifest.digest))
            lossy.check_allowed(
                manifest, allow_lossy=self.allow_lossy, how_to_allow="restore(..., allow_lossy=True) loads it"
            )
            rank = self.group.rank if self.group.rank < manifest.world_size else 0
            record = read_rank_record(tier.store, manifest, rank)
            if record.rng:
                check_rng(record.rng)
            plan = plan_for(manifest, record, tier)
        except StateMismatchError as e:
            local = Failure(str(e), damage=False, mismatch=True)
        except CommitsDifferError as e:  # nothing shows damage: stop, never fall back past it
            local = Failure(str(e), damage=False)
        except _CommittedAgain as e:
            local = Failure(str(e), damage=False, committed_again=True)
        except LossyCopyError as e:  # not damage, but never what a plain restore wants: try the next one
            local = Failure(str(e), damage=True)
        except Exception as e:
            local = failure_of(e)
        agreed = agree(self.group, local)
        if agreed is not None:
            return agreed, None
        reader = CheckpointReader(tier.chunks, manifest, self.pool, self.progress,
                                  agree=(lambda f: agree(self.group, f)) if collective else None,
                                  budget=MemoryBudget(self.buffer_bytes), single_pass=self.single_pass)  # fmt: skip
        try:
            if collective:
                dcp.load(
                    plan.targets, storage_reader=reader, process_group=self.group.pg, no_dist=not self.group.active
                )
            else:  # every rank reads the whole of it by itself
                dcp.load(plan.targets, storage_reader=reader, no_dist=True)
            local = None
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            local = failure_of(e)
        agreed = agree(self.group, local)
        if agreed:
            return agreed, None
        self.loaded = reader.loaded
        return None, (manifest, record, plan)


PlanFor = Callable[[Manifest, RankRecord, Tier], LoadPlan]  # the targets to load a checkpoint into


class _CommittedAgain(Exception):
    """The commit at a step is not one the selector accepted there (``Failure.committed_again``)."""


@dataclass(frozen=True, kw_only=True)
class Found:
    step: int
    tier: Tier
    manifest: Manifest
    record: RankRecord
    plan: LoadPlan
    skipped: list[tuple[int, str]]
    hot_rejected: set[int]
    choice: selection.Choice
