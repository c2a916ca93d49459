"""The landing sensor: new commit records become partitions and validation runs.

One ``SensorResult`` both adds the dynamic partitions and requests their runs, so a
partition never exists without its validation having been requested (and a tick that
fails adds neither).

What is new is decided by the commit record itself, not by its step: a step can be
committed twice (restore rejected the first commit, training fell back and saved that
step again), and the second commit needs its own validation. So the cursor is a
watermark on the commit records' modification times (``{"t": newest seen, "seen":
[commits within SLACK of it]}``): a tick lists the store (names, sizes and times; no
reads), reads only the commit records at or after the watermark that it has not seen,
and requests a run per commit whose run key holds the manifest digest. A commit that
already has a validation record for its digest (the demo's in-process driver wrote
one) gets its partition but no new run.

A tick does not list every step of every run: the cursor keeps, per run, the newest
step landed (its ``frontier``), and a tick lists each run from there on (S3
``StartAfter``: two requests per run when nothing is new, at 10,000 checkpoints as at
ten). A commit behind the frontier (a deeper fallback re-saving older steps, an import
of old steps) is found by the full listing a tick does every ``FULL_SCAN_S``; a step
committed again at the frontier (restore rejected the newest, training saved it anew)
is found at once.

``MAX_PER_TICK`` pages a large backlog: commits are taken oldest first and the
watermark moves only as far as the last one taken. ``SLACK`` absorbs clock skew
between writers of a shared store. A commit record that cannot be read for a
transient reason (the store is unavailable) stops the tick there and is retried.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from assets.checkpoints import checkpoint
from assets.freshness import RPO_FRESHNESS_KEY
from assets.partitions import DIGEST_TAG, checkpoint_key, checkpoints_partitions
from ckptflow import catalog, catalog_listing
from ckptflow.lifecycle.records import Subject, read_record
from ckptflow.manifest import Manifest
from ckptflow.store import Store
from resources import CheckpointStoreResource
from sensors.intervals import SENSOR_INTERVAL_S

MAX_PER_TICK = 500
SLACK = 60.0  # seconds
FULL_SCAN_S = 300.0  # a tick lists every step of every run at least this often
LANE_TAG = "ckptflow/lane"  # validation / evaluation / archival: what the run queue limits by

validation_job = define_asset_job(
    "validate_checkpoint",
    # the checkpoint with its blocking integrity check; the store-wide RPO check runs on its own cadence
    selection=AssetSelection.assets(checkpoint) - AssetSelection.checks(RPO_FRESHNESS_KEY),
    description=(
        "Verify a newly committed checkpoint (manifest, rank records, every chunk) and register it. "
        "A corrupt checkpoint fails this run: its blocking integrity check blocked it, and the failure says why."
    ),
)


@dataclass(frozen=True, kw_only=True)
class Landed:
    key: str  # the partition key
    digest: str  # "" when the commit record could not be read (its validation will say why)
    marker: str  # what makes this commit's run key unique
    validated: bool  # a validation record exists for this digest already


def _seen_id(entry: catalog_listing.StepListing) -> str:
    assert entry.manifest is not None
    return f"{entry.run}/{entry.step}@{entry.manifest.mtime!r}"


def new_commits(store: Store, cursor: dict, limit: int, now: float | None = None) -> tuple[list[Landed], dict]:
    """Commit records not yet landed (oldest first, at most ``limit``) and the cursor after them."""
    t = float(cursor.get("t", float("-inf")))
    seen = set(cursor.get("seen", []))
    frontier = {str(k): int(v) for k, v in dict(cursor.get("frontier", {})).items()}
    now = time.time() if now is None else now
    full_at = cursor.get("full_at")
    full = full_at is None or now - float(full_at) >= FULL_SCAN_S
    steps = catalog_listing.listing(store, from_steps=None if full else frontier, manifests_only=True)
    listed = [e for e in steps if isinstance(e, catalog_listing.StepListing)]
    fresh = [e for e in listed if e.manifest is not None and e.manifest.mtime >= t - SLACK and _seen_id(e) not in seen]
    fresh.sort(key=lambda e: (e.manifest.mtime, e.run, e.step))  # type: ignore[union-attr]
    taken = fresh[:limit]
    landed: list[Landed] = []
    done: list[catalog_listing.StepListing] = []
    manifests = list(zip(taken, catalog.committed(store, listed=taken)))
    with ThreadPoolExecutor(16, thread_name_prefix="ckptflow-landing") as pool:
        validated = list(pool.map(_validated, [store] * len(manifests), [item for _, item in manifests]))
    for (entry, item), was_validated in zip(manifests, validated):
        key = checkpoint_key(entry.run, entry.step)
        if isinstance(item, Manifest):
            landed.append(Landed(key=key, digest=item.digest, marker=item.digest[:16], validated=was_validated))
        elif item.kind == "unavailable":
            break  # retried next tick: a store that did not answer proves nothing about the checkpoint
        else:
            marker = f"unreadable-{entry.manifest.mtime:.0f}"  # type: ignore[union-attr]
            landed.append(Landed(key=key, digest="", marker=marker, validated=False))
        t = max(t, entry.manifest.mtime)  # type: ignore[union-attr]
        seen.add(_seen_id(entry))
        done.append(entry)
    seen = {s for s in seen if float(s.rsplit("@", 1)[1]) >= t - SLACK}
    after = {"t": t, "seen": sorted(seen), "frontier": _frontier(frontier, listed, fresh, done)}
    after["full_at"] = now if full else full_at
    return landed, after


def _validated(store: Store, item: Manifest | catalog_listing.Problem) -> bool:
    return isinstance(item, Manifest) and read_record(store, Subject.of(item), "validation") is not None


def _frontier(
    before: dict[str, int],
    listed: list[catalog_listing.StepListing],
    fresh: list,
    done: list[catalog_listing.StepListing],
) -> dict[str, int]:
    """Per run, the step the next quick tick lists from: the newest committed step, or
    the oldest fresh commit this tick left for the next one (paging, an outage)."""
    out = dict(before)
    for entry in listed:
        if entry.committed:
            out[entry.run] = max(out.get(entry.run, entry.step), entry.step)
    finished = set(done)
    for entry in (e for e in fresh if e not in finished):
        out[entry.run] = min(out[entry.run], entry.step)
    return out


@sensor(job=validation_job, minimum_interval_seconds=SENSOR_INTERVAL_S, default_status=DefaultSensorStatus.RUNNING)
def landing_sensor(context: SensorEvaluationContext, store: CheckpointStoreResource):
    """Adds a ``checkpoints`` partition per new commit record and requests its validation."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    if not isinstance(cursor.get("seen", []), list):
        cursor = {}  # a cursor of an older layout: start over (validated commits are passed over)
    landed, cursor = new_commits(store.open(), cursor, MAX_PER_TICK)
    cursor_json = json.dumps(cursor, sort_keys=True)
    if not landed:
        return SensorResult(skip_reason=SkipReason("no new commit records"), cursor=cursor_json)
    known = set(context.instance.get_dynamic_partitions(checkpoints_partitions.name))
    new_keys = sorted({c.key for c in landed} - known)
    requests = [
        RunRequest(
            run_key=f"{c.key}@{c.marker}",
            partition_key=c.key,
            tags={LANE_TAG: "validation", **({DIGEST_TAG: c.digest} if c.digest else {})},
        )
        for c in landed
        if not c.validated
    ]
    context.log.info(
        f"{len(landed)} new commit record(s); {len(new_keys)} new partition(s), {len(requests)} validation run(s)"
    )
    return SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new_keys)] if new_keys else [],
        cursor=cursor_json,
    )
