"""Validation: verify a checkpoint completely and record the verdict for its digest; and
the rule for using a commit whose verdict is "failed" (``check_not_failed``)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ckptflow import catalog
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.lifecycle.records import Subject, read_record, write_record
from ckptflow.manifest import Manifest
from ckptflow.store.base import Store


def validate(store: Store, run: str, step: int, *, records: Store | None = None) -> dict[str, Any]:
    """Verify manifest, rank records and every chunk of ``(run, step)`` in ``store`` and
    record the verdict in ``records`` (the hot store, when ``store`` is the archive tier
    holding the checkpoint). A checkpoint without a commit record gets no record.

    A verdict needs proof: when something could not be read (an outage, a cold or denied
    object) and nothing proved damage, no record is written (an earlier verdict stands)
    and ``StoreUnavailableError`` says what could not be read, to retry later."""
    report = catalog.verify_checkpoint(store, run, step)
    if report.unavailable:
        unread = report.problems
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise StoreUnavailableError(
            f"could not verify run {run} step {step} in {store.url}: {unread[0]}{more}; nothing proved it "
            "damaged, so no verdict was recorded: retry when the store answers"
        )
    verdict = {
        "ok": report.ok,
        "problems": report.problems[:20],
        "chunks_checked": report.chunks_checked,
        "bytes_checked": report.bytes_checked,
        "tier": store.url,
    }
    if not report.digest:
        return {**verdict, "manifest_digest": ""}
    return write_record(records or store, Subject(run, step, report.digest), "validation", verdict)


def check_not_failed(records: Store, manifest: Manifest, *, allow_failed: bool, how_to_allow: str) -> dict | None:
    """The failed validation verdict of exactly this commit (its manifest digest), or None.

    Without ``allow_failed`` a failed verdict raises ``CkptflowError`` saying when it was
    recorded, what failed and how to go on (``how_to_allow``: the caller's opt-in). The
    verdict stands until validation runs again, even if the bytes verify now: a record
    is history, and only a new validation replaces it."""
    verdict = read_record(records, Subject.of(manifest), "validation")
    if verdict is None or verdict.get("ok"):
        return None
    if not allow_failed:
        recorded = verdict.get("recorded_at")
        when = (
            datetime.fromtimestamp(recorded, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if isinstance(recorded, (int, float))
            else "at an unknown time"
        )
        problems = [str(p) for p in verdict.get("problems") or []] or ["no problem recorded"]
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CkptflowError(
            f"run {manifest.run!r} step {manifest.step} failed validation (recorded {when} for manifest "
            f"{manifest.digest[:12]}…, in {verdict.get('tier') or records.url}): {'; '.join(problems[:3])}{more}. "
            "Refused: part of this commit was proved damaged, so none of it is trusted. Choose another step, "
            f"validate this one again if it was repaired, or {how_to_allow}"
        )
    return verdict
