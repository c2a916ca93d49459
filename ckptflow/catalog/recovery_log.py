"""Recovery records: one small JSON record per restore, under ``recoveries/<run>/`` in the hot store.

Written by ``Checkpointer.restore`` (rank 0) on the training path, so it lives below the
reports that turn these records into numbers (``ckptflow.reports.recoveries``). GC never touches
``recoveries/``.

A restore refused for the caller's side (a state whose structure differs from the
checkpoint's) is recorded as *rejected*, with the reason (``REJECTED_STATE_MISMATCH``): it
says nothing about the checkpoints or the store, so the recovery figures count it apart
(``rejected``), never as a failed recovery.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from ckptflow.catalog.records import is_number, read_object
from ckptflow.errors import CkptflowError, ManifestError, ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store

PREFIX = "recoveries/"
REJECTED_STATE_MISMATCH = "state mismatch"  # StateMismatchError: the state passed does not fit the checkpoint
log = logging.getLogger("ckptflow")


def record(
    store: Store,
    run: str,
    *,
    ok: bool,
    step: int | None,
    skipped: list,
    tier: str | None,
    duration_s: float,
    error: str | None = None,
    digest: str | None = None,
    select: str = "latest",
    passed_over: list | None = None,
    rejected: str | None = None,
) -> None:
    """Write one recovery record; best effort, so a read-only restore still restores.
    ``rejected``: why the restore was refused for the caller's side (``rejected``)."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    key = f"{PREFIX}{fmt.validate_run(run)}/{stamp}-{uuid.uuid4().hex[:8]}.json"
    body = {
        "run": run,
        "at": now,
        "ok": ok,
        "step": step,
        "digest": digest,  # the manifest digest of the commit loaded: which commit, not just which step
        "skipped": [[s, r] for s, r in skipped],
        "tier": tier,
        "duration_s": round(duration_s, 4),
        "error": error,
        "select": select,  # the selector that chose what to recover to (catalog.selection.describe)
        "passed_over": [[s, r] for s, r in passed_over or []],  # newer checkpoints it did not accept, and why
        "rejected": rejected,  # None, or why it was refused for the caller's side: not a failed recovery
    }
    try:
        store.put_if_absent(key, json.dumps(body, sort_keys=True).encode())
    except (CkptflowError, OSError) as e:
        log.debug("could not record the recovery in %s: %s", store.url, e)


def read_all(store: Store, run: str | None = None) -> list[dict]:
    """Recovery records, oldest first (one listing plus small reads). A damaged record (too
    large, not JSON, not an object, or a field of another type than ``record`` writes) is
    skipped with a warning naming it: every report built on these records compares ``at``,
    counts ``ok`` and averages ``duration_s``, so one such record crashed them or skewed them."""
    prefix = PREFIX if run is None else f"{PREFIX}{fmt.validate_run(run)}/"
    out = []
    for info in store.list(prefix):
        try:
            body = read_object(store, info.key)
        except ObjectNotFoundError:
            continue
        except ManifestError as e:
            _skip(e)
            continue
        if problem := _problem(body):
            _skip(f"recovery record {store.url}/{info.key} {problem}: it is damaged")
        else:
            out.append(body)
    return sorted(out, key=lambda r: r["at"])


def rejected(body: dict) -> str | None:
    """Why the restore of this record was refused for the caller's side (a state that does not
    fit the checkpoint), or None: a recovery that counts, loaded or failed. A rejected restore
    is left out of the recoveries and their success rate, which measure checkpoints and stores."""
    return body.get("rejected")


def _problem(body: dict) -> str | None:
    """What in a recovery record is not of the type ``record`` writes (None if nothing)."""
    if not is_number(body.get("at"), minimum=0):
        return f"has 'at' = {body.get('at')!r}, not a time"
    if type(body.get("ok")) is not bool:
        return f"has 'ok' = {body.get('ok')!r}, not true or false"
    step, duration = body.get("step"), body.get("duration_s")
    if step is not None and (type(step) is not int or step < 0):
        return f"has 'step' = {step!r}, not a step number"
    if duration is not None and not is_number(duration, minimum=0):
        return f"has 'duration_s' = {duration!r}, not a duration"
    if not all(isinstance(body.get(k, []), list) for k in ("skipped", "passed_over")):
        return "has 'skipped' or 'passed_over' that is not a list"
    if body.get("rejected") is not None and (not isinstance(body["rejected"], str) or not body["rejected"]):
        return f"has 'rejected' = {body['rejected']!r}, not a reason"
    if body.get("rejected") is not None and body["ok"]:
        # the figures leave a rejected restore out, the advice counts a loaded one: it must be one or the other
        return f"has 'rejected' = {body['rejected']!r} and 'ok' true: a rejected restore loads nothing"
    return None


def _skip(problem: object) -> None:
    log.warning("%s; it is left out of the recovery figures (delete it)", problem)
