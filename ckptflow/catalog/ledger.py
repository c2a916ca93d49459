"""The ledger of expired checkpoints: what retention deleted, so the cost model can say
what keeping it would have cost.

One small JSON object per expired commit, ``ledger/expired/<run>/<step:012d>-<digest>.json``
in the store it was expired from, written before the commit record is deleted (a failed
expiry leaves an entry for a checkpoint that still exists, which readers ignore by
checking what is held). GC never sweeps ``ledger/``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store

PREFIX = "ledger/expired/"


def record_expiry(store: Store, manifest: Manifest) -> None:
    key = f"{PREFIX}{manifest.run}/{manifest.step:0{fmt.STEP_DIGITS}d}-{manifest.digest}.json"
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


def expired(store: Store) -> list[dict[str, Any]]:
    """Every ledger entry of ``store`` (unreadable ones skipped)."""
    out = []
    for info in store.list(PREFIX):
        try:
            entry = json.loads(store.get(info.key))
        except (CkptflowError, ValueError, RecursionError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("logical_bytes"), int):
            out.append(entry)
    return out
