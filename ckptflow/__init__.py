"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it. Every error ckptflow raises on
purpose derives from ``CkptflowError`` and is importable from here.

What needs torch (the ``Checkpointer`` and friends) is imported on first use, so the
``ckptflow`` command can list, verify and collect a store without paying for it.
"""

from typing import TYPE_CHECKING, Any

from ckptflow.catalog import CheckpointInfo, VerifyReport
from ckptflow.catalog_listing import Problem
from ckptflow.errors import (
    CheckpointExistsError,
    CkptflowError,
    ColdObjectError,
    CorruptChunkError,
    ExpireError,
    InvalidNameError,
    ManifestError,
    NoValidCheckpointError,
    ObjectNotFoundError,
    PartialRestoreError,
    PromotionError,
    RegistryError,
    StateMismatchError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
    UnsupportedStateError,
)
from ckptflow.gc import GCReport, gc
from ckptflow.manifest import Manifest
from ckptflow.save_policy import SavePolicy
from ckptflow.store import Store, open_store

_LAZY = {
    "Checkpointer": "ckptflow.checkpointer",
    "RestoreResult": "ckptflow.restore",
    "SaveHandle": "ckptflow.checkpointer",
    "SaveResult": "ckptflow.checkpointer",
    "per_rank": "ckptflow.tree",
}

if TYPE_CHECKING:
    from ckptflow.checkpointer import Checkpointer, SaveHandle, SaveResult
    from ckptflow.restore import RestoreResult
    from ckptflow.tree import per_rank


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptflow' has no attribute {name!r}")


__all__ = [
    "CheckpointExistsError",
    "CheckpointInfo",
    "Checkpointer",
    "CkptflowError",
    "ColdObjectError",
    "CorruptChunkError",
    "ExpireError",
    "GCReport",
    "InvalidNameError",
    "Manifest",
    "ManifestError",
    "NoValidCheckpointError",
    "PartialRestoreError",
    "ObjectNotFoundError",
    "Problem",
    "PromotionError",
    "RegistryError",
    "RestoreResult",
    "SaveHandle",
    "SaveResult",
    "SavePolicy",
    "StateMismatchError",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "UnsupportedStateError",
    "VerifyReport",
    "gc",
    "open_store",
    "per_rank",
]
