"""``Checkpointer``: the API training code calls on every rank.

Saves go through torch.distributed.checkpoint into a content-addressed store; restores
pick the newest checkpoint whose every chunk verifies on every rank, and only then read
it into the live model, in place (``ckptflow.training.restore``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch.distributed.checkpoint as dcp

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import selection
from ckptflow.catalog.checkpoints import CheckpointInfo, VerifyReport
from ckptflow.catalog.tiers import Tier, open_tiers
from ckptflow.chunks.budget import DEFAULT_RESTORE_BUFFER, MemoryBudget
from ckptflow.chunks.lossy import record_problem as lossy_record_problem
from ckptflow.dcp.auto_codec import AutoCodec, BaseIndex, SaveEncoder, delta_base
from ckptflow.dcp.blocking_save import save_tensors
from ckptflow.dcp.collectives import Group
from ckptflow.dcp.failures import own_errors
from ckptflow.dcp.packs import PACK_BYTES
from ckptflow.dcp.regions import Region, Seen, Tracked
from ckptflow.dcp.save_clock import SaveClock
from ckptflow.dcp.save_spec import SaveSpec, check_layout
from ckptflow.dcp.staging import CachedStager
from ckptflow.dcp.writer import CheckpointWriter, Progress
from ckptflow.dcp.written_pages import WriteTracker
from ckptflow.errors import CkptflowError, UnsupportedStateError
from ckptflow.format import layout as fmt
from ckptflow.format.lineage import RunLineage, warn_if_different
from ckptflow.format.manifest import Manifest
from ckptflow.format.state_tree import shared_storage
from ckptflow.policy.adaptive import AdaptivePolicy
from ckptflow.policy.save import SavePolicy
from ckptflow.store import Store, open_store
from ckptflow.training import forks
from ckptflow.training.agreed_policy import AgreedPolicy
from ckptflow.training.collector import collector_paused
from ckptflow.training.recovery_record import record_recovery
from ckptflow.training.restore import Restore, RestoreResult
from ckptflow.training.rewinds import warn_of_newer_steps
from ckptflow.training.save_handle import SaveHandle, SaveResult
from ckptflow.training.save_preflight import claim_step, flatten_on_every_rank
from ckptflow.training.state import capture_rng
from ckptflow.training.warmup import Warmup, warm_up


class Checkpointer:
    def __init__(
        self,
        root: str | Store,
        run: str,
        *,
        policy: SavePolicy | AdaptivePolicy | None = None,
        chunk_bytes: int = 8 << 20,
        pack_bytes: int = PACK_BYTES,
        codec: str = "raw",
        threads: int | None = None,
        process_group: Any = None,
        restore_rng: bool = True,
        progress: Progress | None = None,
        tiers: Sequence[str | Store] = (),
        local: bool = False,
        restore_buffer_bytes: int = DEFAULT_RESTORE_BUFFER,
        lineage: RunLineage | None = None,
        track_writes: bool = True,
    ):
        self.run = fmt.validate_run(run)  # arguments refused before the store is opened: nothing created
        check_layout(chunk_bytes=chunk_bytes, pack_bytes=pack_bytes, codec=codec)
        MemoryBudget(restore_buffer_bytes)  # refused here, not at the first restore
        self.store = open_store(root)
        # host memory a restore may hold beyond the state: decoded chunks kept between its passes
        # and in flight, staging tensors (``ckptflow.chunks.budget``)
        self.restore_buffer_bytes = restore_buffer_bytes
        self.policy = policy
        self.pack_bytes = pack_bytes  # small tensors share chunks of up to this (``ckptflow.dcp.packs``)
        self.chunk_bytes, self.codec, self.progress = chunk_bytes, codec, progress
        self.restore_rng = restore_rng
        # what the run trains on: recorded by every save, compared by every restore
        self.lineage = lineage
        # restore also reads the read-only ``tiers`` (an archive) after this hot store; saves go here only
        self.tiers: list[Tier] = open_tiers(self.store, tiers)
        self.chunks = self.tiers[0].chunks
        self.pool = ThreadPoolExecutor(threads or min(32, 4 * (os.cpu_count() or 1)), thread_name_prefix="ckptflow")
        # local=True: saves and restores by this process alone, even in a torch.distributed job
        self.group = Group(process_group, local=local)
        self._agreed = AgreedPolicy(policy, self.group) if isinstance(policy, AdaptivePolicy) else None
        self._stager = CachedStager()
        self._pending: SaveHandle | None = None
        self._superseded: set[int] = set()
        self._last_commit: int | None = None  # newest step this process committed or restored
        self._auto = AutoCodec() if codec == "auto" else None
        self._full: Manifest | None = None  # the newest full checkpoint this process committed: the delta base
        self._seen: Seen = {}  # per chunk region, the fast checksum and address its last committed save found
        self._tracked: dict[Region, Tracked] = {}  # the regions of ``_seen`` whose pages the kernel watches since
        # which pages blocking saves' tensors were written since the previous save (``written_pages``)
        self._tracker = WriteTracker.open() if track_writes else None
        self._resumed: tuple[int, float] | None = None  # (step, perf_counter) when training last got control back
        forks.follow(self)  # a forked child gets threads of its own

    # ---- save -------------------------------------------------------------------------
    @collector_paused()  # an async save's background write (after this returns) is not paused
    def save(
        self,
        step: int,
        state: MutableMapping[str, Any],
        *,
        metadata: dict | None = None,
        kind: str | None = None,
        blocking: bool = True,
        rng: bool = True,
        lossy: dict | None = None,
    ) -> SaveResult | SaveHandle | None:
        """Write a checkpoint of ``state`` at ``step``.

        ``kind`` defaults to the policy's choice (``None`` from the policy: nothing is
        written and None is returned) or "full" without a policy. With
        ``blocking=False`` the caller is held only while tensors are copied to host
        memory; the returned handle's ``wait()`` gives the result. ``rng=False`` stores no
        RNG state (a checkpoint brought in from elsewhere: this process's RNG is not the run's).
        ``lossy``: the ``lossy`` record of the lossy archive copy ``state`` was read from (an
        import of its export), so this checkpoint too restores only with ``allow_lossy``.

        Tensors of ``state`` that share one storage (tied weights) are recorded in the
        manifest (``tied``), so an export writes them once.
        """
        step = fmt.validate_step(step)
        if self.lineage is not None:
            metadata = self.lineage.merged(metadata)
        if kind is None:
            kind = self.policy.kind_for(step) if self.policy else "full"
            if kind is None:
                return None
        if kind not in ("full", "incremental"):
            raise ValueError(f"kind must be 'full' or 'incremental', got {kind!r}")
        clock = SaveClock.since(self._resumed, step, blocking=blocking)
        self.wait()
        problem = lossy_record_problem(lossy) if lossy is not None else None
        if problem:
            raise UnsupportedStateError(f"{problem}; nothing was saved")
        # refused here: nothing written, nothing moved
        skeleton, tensors = flatten_on_every_rank(state, metadata, self.group)
        base, save_id, replaces = claim_step(self.store, self.run, step, self.group, self.pool, kind=kind,
                                             superseded=self._superseded, last_commit=self._last_commit)  # fmt: skip
        if base is None:
            kind = "full"
        spec = SaveSpec(
            run=self.run,
            step=step,
            kind=kind,
            base_step=base,
            skeleton=skeleton,
            rng=capture_rng() if rng else None,
            metadata=json.loads(json.dumps(metadata or {})),  # as it is now: an async save seals it later
            world_size=self.group.world_size,
            save_id=save_id,
            chunk_bytes=self.chunk_bytes,
            pack_bytes=self.pack_bytes,
            codec=self.codec,
            encoder=self._encoder(step, kind),
            tied=shared_storage(tensors),
            lossy=lossy,
            replaces=replaces,
            clock=clock,
            decision=self.policy.decision(step) if isinstance(self.policy, AdaptivePolicy) else None,
        )
        writer = CheckpointWriter(
            self.chunks,
            spec,
            self.pool,
            self.progress,
            previous=self._seen,
            tracker=self._tracker if blocking else None,  # an async save reads its staged copy
            tracked=self._tracked,
            live=blocking,  # an async save writes its staged copy
        )
        if blocking:
            try:
                with own_errors():
                    save_tensors(tensors, writer, self.group)
            except BaseException:
                self._resumed = (step, time.perf_counter())  # the loop goes on from a failed save too
                raise
            manifest = writer.manifest
            self._committed(step, manifest, writer)
            self._observed(step, clock, time.perf_counter() - clock.started)
            return SaveResult(step=step, kind=kind, info=CheckpointInfo.from_manifest(manifest) if manifest else None)
        with own_errors():
            future = dcp.async_save(
                tensors,
                storage_writer=writer,
                process_group=self.group.pg,
                no_dist=not self.group.active,
                async_stager=self._stager,
            )
        assert isinstance(future, Future)  # AsyncSaveResponse only with a staging future requested
        self._pending = SaveHandle(future, writer, clock.release())
        self._observed(step, clock, self._pending.blocked_s)
        return self._pending

    def _observed(self, step: int, clock: SaveClock, blocked_s: float) -> None:
        """Training resumes now: step times are measured from here; an adaptive policy learns the cost."""
        self._resumed = (step, time.perf_counter())
        if self._agreed is not None:  # the slowest rank's measurements: every rank then decides alike
            self._agreed.observe(step, blocked_s=blocked_s, step_time_s=clock.step_time_s)

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this process committed (its async save waited for) or restored."""
        return self._last_commit

    def _committed(self, step: int, manifest: Manifest | None, writer: CheckpointWriter) -> None:
        """What this process knows once it committed ``step``: the newest commit, the
        newest full (the delta base), what each chunk region held (the next incremental
        save's fast comparison), and that its own commit is no longer one restore rejected."""
        self._last_commit = step
        self._seen, self._tracked = writer.seen, writer.tracked
        self._superseded.discard(step)
        if manifest is not None and manifest.kind == "full":
            self._full = manifest

    def prepare(self, state: MutableMapping[str, Any]) -> None:
        """Allocate now the host buffers async saves copy ``state``'s tensors into (pinned
        when CUDA is present), so even the first ``save(..., blocking=False)`` holds the
        loop only for the copy. Buffers are kept per tensor storage: call it on every rank
        after building the model and optimizer state, and again if tensors are replaced.
        An async save in flight is waited for first: it writes from those very buffers, so
        staging into them meanwhile would put later values into its checkpoint, and its
        collectives run on the group that flattening the state gathers on."""
        self.wait()
        _skeleton, tensors = flatten_on_every_rank(state, None, self.group)
        self._stager.stage(tensors)

    def wait(self) -> SaveResult | None:
        """Block until the async save in flight (if any) is committed."""
        pending, self._pending = self._pending, None
        if pending is None or pending.error_reported:
            return None  # a failure already raised by the handle's own wait() is not raised again
        result = pending.wait()
        self._committed(pending.step, pending.manifest, pending.writer)
        return result

    def _encoder(self, step: int, kind: str) -> SaveEncoder | None:
        """Codec "auto": the save's encoder; an incremental one deltas against the newest
        full checkpoint, which rank 0 names and every rank reads (checked by digest)."""
        if self._auto is None:
            return None
        base = None
        if kind == "incremental":
            full = delta_base(self.store, self.run, step, self.group, self._full, self._last_commit, self._superseded)
            if full is not None:
                self._full, base = full, BaseIndex.of(full)
        return self._auto.for_save(self.chunks, kind, base)

    # ---- restore ----------------------------------------------------------------------
    @collector_paused()
    def restore(
        self,
        state: MutableMapping[str, Any],
        *,
        step: int | None = None,
        select: selection.Selector = "latest",
        strict: bool = True,
        allow_lossy: bool = False,
        warmup: Warmup | None = None,
        single_pass: bool = False,
    ) -> RestoreResult:
        """Load the newest valid checkpoint (or exactly ``step``) into ``state`` in place.

        ``select`` chooses what to recover to (``ckptflow.catalog.selection``): "latest"
        (the default), "validated" (a passing validation verdict on that exact commit),
        ``Best(metric, mode)`` (by evaluation record), ``Alias(model, alias)`` (the commit
        a registry alias was published from) or a step number (as ``step=``). Damage moves
        to the selector's next candidate only; ``result.passed_over`` says which newer
        checkpoints the selector did not accept and why, ``result.select`` which selector chose.

        Every chunk a candidate needs is verified on every rank before any tensor in
        ``state`` is written; damage found on any rank moves all ranks to the next older
        candidate together (``result.skipped`` says why), leaving ``state`` untouched. A
        store that cannot be read raises ``StoreUnavailableError`` instead: only proof of
        damage falls back (``ckptflow.training.restore``). A failure after verification, while the
        chunks are read into place, raises ``PartialRestoreError``: ``state`` is then partly
        written, so restore again or rebuild it. ``step=`` never falls back to another
        step. With ``tiers``, a step is tried in each tier holding it (hot first) before
        moving to an older step. Rank 0 leaves a recovery record in the hot store
        (``ckptflow.reports.recoveries``) either way.

        ``state`` may name a subset of the checkpoint's entries (the rest is not read).
        A state whose structure differs from the checkpoint's raises ``StateMismatchError``
        listing the keys and restores nothing (recorded as rejected, not a failed recovery); ``strict=False``
        loads what matches and lists the rest in ``result.missing_keys`` / ``result.unexpected_keys``.

        A lossy archive copy (``ckptflow.chunks.lossy``) is skipped with the reason unless
        ``allow_lossy``; loaded, ``result.lossy`` says what it lost and
        ``result.not_restored`` which state entries it did not hold (left as they were).

        ``warmup`` (opt-in, ``ckptflow.training.warmup``): after the load, ramp the learning
        rate back, reset momentum or reseed the RNGs as it says; ``result.warmup`` reports it.

        ``single_pass`` (opt-in) reads each chunk into place once and verifies it there. It
        gives up the untouched-on-damage guarantee: a damaged checkpoint raises
        ``PartialRestoreError`` with ``state`` partly overwritten, and does not fall back.
        """
        started = time.perf_counter()
        if warmup is not None:
            warmup.check_names(state)
        chosen = selection.from_arguments(step, select)
        restore = self._restorer(chosen, strict=strict, allow_lossy=allow_lossy, single_pass=single_pass)
        try:
            result = restore(state, chosen)
        except CkptflowError as e:
            record_recovery(self.store, self.run, self.group, started, error=e, select=selection.describe(chosen))
            raise
        self._restored(started, result, restore.loaded)
        if warmup is not None:
            result = replace(result, warmup=warm_up(result, state, warmup, rank=self.group.rank))
        self._resumed = (result.step, time.perf_counter())
        return result

    def _restorer(
        self, chosen: selection.Selector, *, strict: bool = True, allow_lossy: bool = False, single_pass: bool = False
    ) -> Restore:
        """A restore of ``chosen`` over this run's tiers, once the save in flight has committed."""
        self.wait()
        return Restore(
            self.tiers,
            self.run,
            self.group,
            self.pool,
            self.progress,
            restore_rng=self.restore_rng,
            strict=strict,
            allow_lossy=allow_lossy,
            buffer_bytes=self.restore_buffer_bytes,
            single_pass=single_pass,
            registry=selection.registry_store(chosen),
        )

    def _restored(self, started: float, result: RestoreResult, loaded: Seen) -> None:
        """What this process knows after loading ``result``: steps a save may now replace, the
        newest commit, the chunk regions it loaded from the hot store (the next save hashes
        only what changed since), the recovery record, and whether the lineage differs."""
        self._superseded = set(result.hot_rejected) | selection.failed_steps(result.passed_over)
        hot = result.tier == self.store.url
        self._last_commit, self._seen = (result.step, loaded) if hot else (None, {})
        warn_of_newer_steps(self.store, self.run, result, self._superseded, rank=self.group.rank)
        self._tracked = {}  # the loaded regions were written since: the next save reads them
        record_recovery(self.store, self.run, self.group, started, result=result)
        if self.lineage is not None:
            warn_if_different(self.lineage, result.metadata, f"run {self.run!r} resumed from step {result.step}")

    def load(
        self, *, step: int | None = None, select: selection.Selector = "latest"
    ) -> tuple[RestoreResult, dict[str, Any]]:
        """The newest valid checkpoint (or exactly ``step``) as a new state: nested dicts,
        full tensors (DTensor shards gathered) and the JSON values as saved. For code with
        no live objects to restore into, such as a framework that asks for its checkpoint
        dict back; the same verification, selectors and fallback rules as ``restore``."""
        started = time.perf_counter()
        chosen = selection.from_arguments(step, select)
        restore = self._restorer(chosen)
        try:
            result, state = restore.load(chosen)
        except CkptflowError as e:
            record_recovery(self.store, self.run, self.group, started, error=e, select=selection.describe(chosen))
            raise
        self._restored(started, result, restore.loaded)
        return result, state

    # ---- inspection -------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        return catalog.list_checkpoints(self.store, self.run)

    def verify(self, step: int, *, deep: bool = True) -> VerifyReport:
        """``deep``: every chunk re-hashed against its address; else the fast checksums restore checks."""
        step = fmt.validate_step(step)
        return catalog.verify_checkpoint(self.store, self.run, step, self.pool, self.progress, deep=deep)

    def close(self) -> None:
        self.wait()
        self._stager.close()
        self.pool.shutdown()
        if self._tracker is not None:
            self._tracker.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
