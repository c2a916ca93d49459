"""Recovery records: one small JSON record per restore, under ``recoveries/<run>/`` in the hot store.

Written by ``Checkpointer.restore`` (rank 0) on the training path, so it lives below the
reports that turn these records into numbers (``ckptflow.reports.recoveries``). GC never touches
``recoveries/``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from ckptflow.errors import CkptflowError, ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.store.base import Store

PREFIX = "recoveries/"
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
) -> None:
    """Write one recovery record; best effort, so a read-only restore still restores."""
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
    }
    try:
        store.put_if_absent(key, json.dumps(body, sort_keys=True).encode())
    except (CkptflowError, OSError) as e:
        log.debug("could not record the recovery in %s: %s", store.url, e)


def read_all(store: Store, run: str | None = None) -> list[dict]:
    """Recovery records, oldest first (one listing plus small reads)."""
    prefix = PREFIX if run is None else f"{PREFIX}{fmt.validate_run(run)}/"
    out = []
    for info in store.list(prefix):
        try:
            out.append(json.loads(store.get(info.key)))
        except (ObjectNotFoundError, ValueError):
            continue
    return sorted(out, key=lambda r: r.get("at", 0))
