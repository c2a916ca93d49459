"""``Checkpointer``: the API training code calls on every rank.

Saves go through torch.distributed.checkpoint into a content-addressed store; restores
pick the newest checkpoint that verifies, load it into staging buffers, and only touch
the live model once every rank has loaded the same step cleanly.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ckptflow import catalog, lossy, recoveries
from ckptflow import format as fmt
from ckptflow.auto_codec import AutoCodec, BaseIndex, SaveEncoder, delta_base
from ckptflow.catalog import CheckpointInfo, VerifyReport
from ckptflow.codecs import CODECS
from ckptflow.dcp_io import CheckpointReader, CheckpointWriter, Progress, SaveSpec, describe_failure, own_errors
from ckptflow.distributed import Group
from ckptflow.errors import CheckpointExistsError, CkptflowError, LossyCopyError, ManifestError, NoValidCheckpointError
from ckptflow.manifest import Manifest
from ckptflow.save_policy import SavePolicy
from ckptflow.state import capture_rng, flatten, load_state_dicts, restore_rng, to_state_dicts, unflatten
from ckptflow.store import Store, open_store
from ckptflow.tiers import Tier, candidates, open_tiers

log = logging.getLogger("ckptflow")


@dataclass(frozen=True)
class SaveResult:
    step: int
    kind: str
    info: CheckpointInfo | None  # on the coordinator rank; None elsewhere


@dataclass(frozen=True)
class RestoreResult:
    step: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newest first
    metadata: dict = field(default_factory=dict)
    rng_restored: bool = False
    tier: str = ""  # URL of the store it was loaded from (the hot store, or an archive tier)
    lossy: dict | None = None  # a lossy archive copy was loaded (allow_lossy=True): what it lost
    not_restored: list[str] = field(default_factory=list)  # state entries the copy lacks, left as they were


class SaveHandle:
    """An async save in flight. ``wait()`` returns its ``SaveResult`` or raises its error."""

    def __init__(self, future: Future, writer: CheckpointWriter, blocked_s: float):
        self._future, self._writer = future, writer
        self.step, self.kind = writer.spec.step, writer.spec.kind
        self.blocked_s = blocked_s  # how long the caller was held (host copy of tensors)
        self.error_reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            with own_errors():
                self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the save's own failure (not a wait timeout): reported now,
                self.error_reported = True  # so Checkpointer.wait() must not raise it again
            raise
        manifest = self._writer.manifest
        return SaveResult(self.step, self.kind, CheckpointInfo.from_manifest(manifest) if manifest else None)


class Checkpointer:
    def __init__(
        self,
        root: str | Store,
        run: str,
        *,
        policy: SavePolicy | None = None,
        chunk_bytes: int = 8 << 20,
        codec: str = "raw",
        threads: int | None = None,
        process_group: Any = None,
        restore_rng: bool = True,
        progress: Progress | None = None,
        tiers: Sequence[str | Store] = (),
    ):
        self.store = open_store(root)
        self.run = fmt.validate_run(run)
        self.policy = policy
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive number of bytes (default 8 MiB), got {chunk_bytes!r}")
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        self.chunk_bytes, self.codec, self.progress = chunk_bytes, codec, progress
        self.restore_rng = restore_rng
        # restore also reads the read-only ``tiers`` (an archive) after this hot store; saves go here only
        self.tiers: list[Tier] = open_tiers(self.store, tiers)
        self.chunks = self.tiers[0].chunks
        self.pool = ThreadPoolExecutor(threads or min(32, 4 * (os.cpu_count() or 1)), thread_name_prefix="ckptflow")
        self.group = Group(process_group)
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        self._pending: SaveHandle | None = None
        self._superseded: set[int] = set()
        self._last_commit: int | None = None  # newest step this process committed or restored
        self._auto = AutoCodec() if codec == "auto" else None
        self._full: Manifest | None = None  # the newest full checkpoint this process committed: the delta base

    # ---- save -------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: MutableMapping[str, Any],
        *,
        metadata: dict | None = None,
        kind: str | None = None,
        blocking: bool = True,
    ) -> SaveResult | SaveHandle | None:
        """Write a checkpoint of ``state`` at ``step``.

        ``kind`` defaults to the policy's choice (``None`` from the policy: nothing is
        written and None is returned) or "full" without a policy. With
        ``blocking=False`` the caller is held only while tensors are copied to host
        memory; the returned handle's ``wait()`` gives the result.
        """
        fmt.validate_step(step)
        if kind is None:
            kind = self.policy.kind_for(step) if self.policy else "full"
            if kind is None:
                return None
        if kind not in ("full", "incremental"):
            raise ValueError(f"kind must be 'full' or 'incremental', got {kind!r}")
        self.wait()
        started = time.perf_counter()
        base, save_id = self._prepare_step(step)
        if base is None:
            kind = "full"
        skeleton, tensors = flatten(to_state_dicts(state))
        spec = SaveSpec(
            run=self.run,
            step=step,
            kind=kind,
            base_step=base,
            skeleton=skeleton,
            rng=capture_rng(),
            metadata=dict(metadata or {}),
            world_size=self.group.world_size,
            save_id=save_id,
            chunk_bytes=self.chunk_bytes,
            codec=self.codec,
            encoder=self._encoder(step, kind),
        )
        writer = CheckpointWriter(self.chunks, spec, self.pool, self.progress)
        kwargs = dict(storage_writer=writer, process_group=self.group.pg, no_dist=not self.group.active)
        if blocking:
            with own_errors():
                dcp.save(tensors, **kwargs)
            self._last_commit = step
            manifest = writer.manifest
            self._full = manifest if manifest is not None and manifest.kind == "full" else self._full
            return SaveResult(step, kind, CheckpointInfo.from_manifest(manifest) if manifest else None)
        with own_errors():
            future = dcp.async_save(tensors, async_stager=self._stager, **kwargs)  # type: ignore[arg-type]
        assert isinstance(future, Future)  # AsyncSaveResponse only with a staging future requested

        def committed(done: Future) -> None:
            if done.exception() is None:
                self._last_commit = step
                if writer.manifest is not None and writer.manifest.kind == "full":
                    self._full = writer.manifest

        future.add_done_callback(committed)
        self._pending = SaveHandle(future, writer, time.perf_counter() - started)
        return self._pending

    def wait(self) -> SaveResult | None:
        """Block until the async save in flight (if any) is committed."""
        pending, self._pending = self._pending, None
        if pending is None or pending.error_reported:
            return None  # a failure already raised by the handle's own wait() is not raised again
        return pending.wait()

    def _prepare_step(self, step: int) -> tuple[int | None, str]:
        """Rank 0 checks the step is free, finds the base step and names the attempt;
        every rank gets the same answer or raises the same error (a lone raise would
        hang the others in DCP's collectives)."""
        base: int | None = None
        error: CkptflowError | None = None
        if self.group.rank == 0:
            try:
                self._clear_step(step)
                base = self._newest_committed_before(step)
            except CkptflowError as e:
                error = e
        base, error, save_id = self.group.broadcast((base, error, uuid.uuid4().hex))
        if error is not None:
            raise error
        return base, save_id

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

    def _newest_committed_before(self, step: int) -> int | None:
        """The base of an incremental save: known in a training loop without listing the store."""
        if self._last_commit is not None and self._last_commit < step:
            return self._last_commit
        for older in reversed(catalog.committed_steps(self.store, self.run)):
            if older < step and older not in self._superseded:
                return older
        return None

    def _clear_step(self, step: int) -> None:
        """Refuse to overwrite a good commit; move aside one that restore rejected."""
        if not self.store.exists(fmt.manifest_key(self.run, step)):
            return
        try:
            catalog.read_manifest(self.store, self.run, step)
            valid = step not in self._superseded
        except ManifestError:
            valid = False
        if valid:
            raise CheckpointExistsError(
                f"step {step} of run {self.run!r} is already committed in {self.store.url}; "
                "save under a new step, or delete that checkpoint first (retention / `ckptflow gc`)"
            )
        key = fmt.manifest_key(self.run, step)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.store.put_if_absent(fmt.quarantine_key(self.run, step, stamp), self.store.get(key))
        self.store.delete(key)
        log.warning(
            "moved the rejected manifest of step %d aside to %s", step, fmt.quarantine_key(self.run, step, stamp)
        )

    # ---- restore ----------------------------------------------------------------------
    def restore(
        self, state: MutableMapping[str, Any], *, step: int | None = None, allow_lossy: bool = False
    ) -> RestoreResult:
        """Load the newest valid checkpoint (or exactly ``step``) into ``state``; rank 0
        leaves a recovery record in the hot store (``ckptflow.recoveries``) either way.

        A lossy archive copy (``ckptflow.lossy``) is skipped with the reason unless
        ``allow_lossy``; loaded, ``result.lossy`` says what it lost and
        ``result.not_restored`` which state entries it did not hold (left as they were).
        """
        started = time.perf_counter()
        try:
            result = self._restore(state, step, allow_lossy)
        except NoValidCheckpointError as e:
            self._record_recovery(False, None, e.skipped, None, started, str(e))
            raise
        self._record_recovery(True, result.step, result.skipped, result.tier, started)
        return result

    def _record_recovery(
        self, ok: bool, step: int | None, skipped: list, tier: str | None, started: float, error: str | None = None
    ) -> None:
        if self.group.rank == 0:
            recoveries.record(
                self.store,
                self.run,
                ok=ok,
                step=step,
                skipped=skipped,
                tier=tier,
                duration_s=time.perf_counter() - started,
                error=error,
            )

    def _restore(self, state: MutableMapping[str, Any], step: int | None, allow_lossy: bool) -> RestoreResult:
        """Load the newest valid checkpoint (or exactly ``step``) into ``state`` in place.

        Every chunk a candidate needs is verified on every rank before any tensor in
        ``state`` is written; a failure on any rank records the reason and moves all
        ranks to the next older candidate together, leaving ``state`` untouched.
        (Only a chunk file that vanishes or fails between that check and the copy a
        moment later can leave tensors half-written; restore then falls back as well.)
        ``step=`` never falls back to another step: an invalid checkpoint raises
        ``NoValidCheckpointError``. With ``tiers``, a step is tried in each tier holding
        it (hot first) before moving to an older step.
        """
        self.wait()
        if step is not None:
            fmt.validate_step(step)
        pairs = self.group.broadcast(candidates(self.tiers, self.run, step) if self.group.rank == 0 else None)
        _, live = flatten(to_state_dicts(state))
        skipped: list[tuple[int, str]] = []
        hot_rejected: set[int] = set()
        for cand, index in pairs:
            tier = self.tiers[index]
            outcome = self._try_load(cand, live, tier, allow_lossy)
            failures = [f for f in self.group.all_gather(outcome[0]) if f]
            if not failures:
                manifest, record, loaded = outcome[1]
                dropped = lossy.dropped(manifest)  # entries a lossy copy does not hold stay as they are
                kept = {k: v for k, v in state.items() if k not in dropped} if dropped else state
                load_state_dicts(kept, unflatten(record.state, loaded))
                if kept is not state:
                    state.update(kept)
                rng_ok = False
                if self.restore_rng and record.rng and record.rank == self.group.rank:
                    restore_rng(record.rng)
                    rng_ok = True
                self._superseded = hot_rejected
                self._last_commit = cand if index == 0 else None
                lost = dict(manifest.lossy) if manifest.lossy is not None else None
                if lost is not None:
                    log.warning("restored a lossy copy of %s step %d: %s", self.run, cand, lossy.describe(lost))
                return RestoreResult(cand, skipped, dict(manifest.metadata), rng_ok, tier.url, lost, dropped)
            reason = "; ".join(dict.fromkeys(failures))
            if len(self.tiers) > 1:
                reason = f"{tier.url}: {reason}"
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
        self, step: int, live: dict[str, torch.Tensor], tier: Tier, allow_lossy: bool = False
    ) -> tuple[str | None, Any]:
        """(failure reason or None, (manifest, rank record, the loaded live tensors))."""
        try:
            manifest = catalog.read_manifest(tier.store, self.run, step)
            if manifest.lossy is not None:
                if not allow_lossy:
                    raise LossyCopyError(
                        f"a lossy archive copy ({lossy.describe(manifest.lossy)}); "
                        "restore(..., allow_lossy=True) loads it"
                    )
                dropped = lossy.dropped(manifest)
                live = {k: v for k, v in live.items() if k.split(".", 1)[0] not in dropped}
            rank = self.group.rank if self.group.rank < manifest.world_size else 0
            record = catalog.read_rank_record(tier.store, manifest, rank)
            reader = CheckpointReader(tier.chunks, manifest, self.pool, self.progress, agree=self._gathered_failure)
        except (CkptflowError, OSError) as e:
            return self._gathered_failure(str(e)), None
        missing = set(live) - set(manifest.dcp.tensors)
        extra = set(manifest.dcp.tensors) - set(live)
        if missing or extra:
            return self._gathered_failure(
                f"state does not match the checkpoint (missing from checkpoint: {sorted(missing)[:5]}, "
                f"not in current state: {sorted(extra)[:5]})"
            ), None
        if self._gathered_failure(None):
            return "another rank could not read this checkpoint's records", None
        try:
            dcp.load(live, storage_reader=reader, process_group=self.group.pg, no_dist=not self.group.active)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            return describe_failure(e), None
        return None, (manifest, record, live)

    def _gathered_failure(self, reason: str | None) -> str | None:
        """Agree across ranks before any collective load starts (else one rank would hang)."""
        failures = [f for f in self.group.all_gather(reason) if f]
        return "; ".join(dict.fromkeys(failures)) or None

    # ---- inspection -------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        return catalog.list_checkpoints(self.store, self.run)

    def verify(self, step: int) -> VerifyReport:
        return catalog.verify_checkpoint(self.store, self.run, fmt.validate_step(step), self.pool, self.progress)

    def close(self) -> None:
        self.wait()
        self._stager.close()
        self.pool.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
