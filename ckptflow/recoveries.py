"""Recovery records and the operational numbers built from them.

Every ``Checkpointer.restore`` (on rank 0) leaves a small JSON record under
``recoveries/<run>/`` in the hot store: when, which step, what was skipped and why, how
long it took, and whether it succeeded. With the manifests and the lifecycle
verdicts that gives the figures an operator asks for: recoveries and their success
rate, how often checkpoints land, and how long a checkpoint takes to become
recovery-ready (committed and validated). GC never touches ``recoveries/``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.errors import CkptflowError, ObjectNotFoundError
from ckptflow.lifecycle.records import records_by_subject
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
        "skipped": [[s, r] for s, r in skipped],
        "tier": tier,
        "duration_s": round(duration_s, 4),
        "error": error,
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


@dataclass(frozen=True)
class RunMetrics:
    run: str
    checkpoints: int
    save_interval_s: float | None  # median time between consecutive commits
    ready_s: float | None  # median time from commit to a passed validation (recovery-ready)
    recoveries: int
    recoveries_ok: int
    fallbacks: int  # recoveries that had to skip at least one checkpoint
    restore_s: float | None  # median duration of successful recoveries

    @property
    def recovery_success_rate(self) -> float | None:
        return self.recoveries_ok / self.recoveries if self.recoveries else None

    def as_dict(self) -> dict:
        return {**asdict(self), "recovery_success_rate": self.recovery_success_rate}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_metrics(store: Store, run: str) -> RunMetrics:
    infos = catalog.list_checkpoints(store, run)
    created = sorted(i.created_at for i in infos)
    records = records_by_subject(store, run)
    ready = []
    for info in infos:
        verdict = records.get((run, info.step, info.digest), {}).get("validation")
        if verdict and verdict.get("ok") and isinstance(verdict.get("recorded_at"), (int, float)):
            ready.append(max(0.0, verdict["recorded_at"] - info.created_at))
    recs = read_all(store, run)
    ok = [r for r in recs if r.get("ok")]
    return RunMetrics(
        run=run,
        checkpoints=len(infos),
        save_interval_s=_median([b - a for a, b in zip(created, created[1:])]),
        ready_s=_median(ready),
        recoveries=len(recs),
        recoveries_ok=len(ok),
        fallbacks=sum(1 for r in recs if r.get("skipped")),
        restore_s=_median([r["duration_s"] for r in ok if isinstance(r.get("duration_s"), (int, float))]),
    )


def store_metrics(store: Store) -> list[RunMetrics]:
    """Every run with checkpoints or recoveries (a run whose every recovery failed may have none)."""
    recovered = {
        info.key[len(PREFIX) :].rstrip("/") for info in store.list(PREFIX, recursive=False) if info.key.endswith("/")
    }
    return [run_metrics(store, run) for run in sorted(set(catalog.list_runs(store)) | recovered)]
