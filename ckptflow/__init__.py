"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it. Every error ckptflow raises on
purpose derives from ``CkptflowError``; every one a caller can receive is defined in
``ckptflow.errors`` and importable from here. (``ckptflow.failures`` keeps two more that
carry a verdict out of DCP's load and never reach a caller; the command line reports
its ``UsageError`` itself.)

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
    DcpFormatError,
    ExpireError,
    InvalidNameError,
    LossyCopyError,
    ManifestError,
    NoValidCheckpointError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PartialRestoreError,
    PromotionError,
    RecordTooLargeError,
    RegistryError,
    StateMismatchError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreUnavailableError,
    SymlinkError,
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
    "DcpFormatError",
    "ExpireError",
    "GCReport",
    "InvalidNameError",
    "LossyCopyError",
    "Manifest",
    "ManifestError",
    "NoValidCheckpointError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PartialRestoreError",
    "Problem",
    "PromotionError",
    "RecordTooLargeError",
    "RegistryError",
    "RestoreResult",
    "SaveHandle",
    "SaveResult",
    "SavePolicy",
    "StateMismatchError",
    "Store",
    "StoreError",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "SymlinkError",
    "UnsupportedStateError",
    "VerifyReport",
    "gc",
    "open_store",
    "per_rank",
]
