"""Validation: verify a checkpoint completely and record the verdict for its digest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.verdicts import Subject, carried_failure, is_carried, write_record
from ckptflow.errors import ColdObjectError, NewerFormatError, StoreUnavailableError
from ckptflow.store.base import Store


def validate(
    store: Store,
    run: str,
    step: int,
    *,
    records: Store | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Verify manifest, rank records and every chunk of ``(run, step)`` in ``store`` and
    record the verdict in ``records`` (the hot store, when ``store`` is the archive tier
    holding the checkpoint). A checkpoint without a commit record gets no record.
    ``progress`` is called, from the verifying threads, with each chunk's content size
    once it is checked: a multi-GB checkpoint takes minutes, and the calls add up to the
    verdict's ``bytes_checked``.

    A verdict needs proof: when something could not be read (an outage, a cold or denied
    object) and nothing proved damage, no record is written (an earlier verdict stands)
    and ``StoreUnavailableError`` says what could not be read, to retry later
    (``ColdObjectError`` where some of it is cold: thaw it first; ``NewerFormatError``: a
    newer ckptflow wrote it, upgrade to validate it)."""
    report = catalog.verify_checkpoint(store, run, step, progress=progress)
    if report.newer is not None:
        raise NewerFormatError(
            f"could not verify run {run} step {step} in {store.url}: {report.newer.message}; no verdict was recorded"
        )
    if report.unavailable:
        # a cold object first: its thaw instruction is what must be done before anything reads it
        unread = [p.message for p in sorted(report.findings, key=lambda p: p.kind != "cold")]
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        error = ColdObjectError if report.cold else StoreUnavailableError
        raise error(
            f"could not verify run {run} step {step} in {store.url}: {unread[0]}{more}; nothing proved it "
            "damaged, so no verdict was recorded: "
            + ("thaw it, then validate again" if report.cold else "retry when the store answers")
        )
    carried = carried_failure(report.metadata)  # the verdict an import with allow_failed carries stands
    verdict = {
        "ok": report.ok and carried is None,
        "problems": report.problems[:20] + ([carried] if carried else []),  # damage found first
        "chunks_checked": report.chunks_checked,
        "bytes_checked": report.bytes_checked,
        "tier": store.url,
    }
    if not report.digest:
        return {**verdict, "manifest_digest": ""}
    return write_record(records or store, Subject(run, step, report.digest), "validation", verdict)


def found_damage(verdict: Mapping[str, Any]) -> list[str]:
    """The problems ``validate`` found in the checkpoint's own bytes, which scrub lists as
    corrupt and repair must mend: not the verdict an import with ``allow_failed`` carries
    (``is_carried``), which fails it without proving any damage."""
    if verdict["ok"]:
        return []
    return [p for p in verdict["problems"] if not is_carried(p)]
