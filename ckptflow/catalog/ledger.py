"""The ledger of expired checkpoints: what retention deleted, so the cost model can say
what keeping it would have cost.

One small JSON object per expired commit, ``ledger/expired/<run>/<step:012d>-<digest>.json``
in the store it was expired from, written before the commit record is deleted (a failed
expiry leaves an entry for a checkpoint that still exists, which readers ignore by
checking what is held). ``ledger/expiring/`` holds a marker per expiry deleting a commit's
lifecycle records, deleted when it is done: retention finishes those left (``unfinished_expiries``).
GC never sweeps ``ledger/``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ckptflow.catalog.records import is_number, read_object
from ckptflow.errors import CkptflowError, ObjectNotFoundError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

PREFIX = "ledger/expired/"
log = logging.getLogger("ckptflow")
EXPIRING = "ledger/expiring/"  # expiries deleting records now (or that failed doing so)


def _entry_key(run: str, step: int, digest: str) -> str:
    return f"{PREFIX}{fmt.validate_run(run)}/{fmt.validate_step(step):0{fmt.STEP_DIGITS}d}-{digest}.json"


def record_expiry(store: Store, manifest: Manifest) -> None:
    key = _entry_key(manifest.run, manifest.step, manifest.digest)
    body = {
        "run": manifest.run,
        "step": manifest.step,
        "digest": manifest.digest,
        "kind": manifest.kind,
        "logical_bytes": manifest.stats.logical_bytes,
        "stored_bytes": manifest.stats.stored_bytes,
        "created_at": manifest.created_at,
        "expired_at": time.time(),
    }
    store.replace(key, json.dumps(body, sort_keys=True).encode())


def was_expired(store: Store, run: str, step: int, digest: str) -> bool:
    """Whether the ledger has an entry for commit ``digest`` of ``(run, step)`` (an expiry
    begun: whether it finished is what the store still holds)."""
    return store.exists(_entry_key(run, step, digest))


def expiry_begun(store: Store, run: str, step: int, digest: str) -> str:
    """Note that the expiry of commit ``digest`` at ``(run, step)`` is deleting its records:
    one that fails (or dies) after its commit record went is in no later plan, so
    ``unfinished_expiries`` is how retention finds it. Returns the key, for ``expiry_done``."""
    key = f"{EXPIRING}{fmt.validate_run(run)}/{fmt.validate_step(step):0{fmt.STEP_DIGITS}d}-{digest}.json"
    store.replace(key, b"{}")
    return key


def expiry_done(store: Store, key: str) -> None:
    store.delete(key)


def unfinished_expiries(store: Store) -> list[tuple[str, int, str, str]]:
    """``(run, step, digest, key)`` of every expiry begun and not done: key names only."""
    found = []
    for info in store.list(EXPIRING):
        run, _, name = info.key[len(EXPIRING) :].partition("/")
        step, _, digest = name.removesuffix(".json").partition("-")
        if step.isdigit() and fmt.is_digest(digest):
            found.append((run, int(step), digest, info.key))
    return found


def expired(store: Store, run: str | None = None) -> list[dict[str, Any]]:
    """Every ledger entry of ``store`` (of ``run`` only, if given). An unreadable or damaged
    one (too large, not JSON, or without the run, step, digest and byte count
    ``record_expiry`` writes) is skipped with a warning naming it: the cost report keys
    entries by commit and sums their bytes, so one crashed it (KeyError, TypeError) or priced
    retention at a negative 4.5 TiB."""
    out = []
    for info in store.list(PREFIX if run is None else f"{PREFIX}{fmt.validate_run(run)}/"):
        try:
            entry = read_object(store, info.key)
        except ObjectNotFoundError:
            continue
        except CkptflowError as e:
            log.warning("%s; the ledger entry is left out of the cost report", e)
            continue
        step, nbytes = entry.get("step"), entry.get("logical_bytes")
        if (
            isinstance(entry.get("run"), str)
            and type(step) is int
            and step >= 0
            and isinstance(entry.get("digest", ""), (str, type(None)))
            and type(nbytes) is int
            and is_number(nbytes, minimum=0)
        ):
            out.append(entry)
        else:
            log.warning(
                "ledger entry %s/%s has no run, step, digest and byte count of the types ckptflow writes: it is "
                "damaged and left out of the cost report (delete it)",
                store.url,
                info.key,
            )
    return out
