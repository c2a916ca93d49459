"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it. Every error ckptflow raises on
purpose derives from ``CkptflowError`` and is importable from here.

``Checkpointer`` and its result types are imported on first use: they bring torch
(about 1.5 s), which the store, catalog and lifecycle do not need, and every Dagster
run process and ``ckptflow`` command imports this package.
"""

from typing import TYPE_CHECKING

from ckptflow.catalog import CheckpointInfo, Problem, VerifyReport
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
    PromotionError,
    RegistryError,
    StoreError,
    StoreNotFoundError,
    UnsupportedStateError,
)
from ckptflow.gc import GCReport, gc
from ckptflow.manifest import Manifest
from ckptflow.save_policy import SavePolicy
from ckptflow.store import Store, open_store

if TYPE_CHECKING:
    from ckptflow.checkpointer import Checkpointer, RestoreResult, SaveHandle, SaveResult

_CHECKPOINTER = ("Checkpointer", "RestoreResult", "SaveHandle", "SaveResult")


def __getattr__(name: str):
    if name in _CHECKPOINTER:
        from ckptflow import checkpointer

        return getattr(checkpointer, name)
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
    "ObjectNotFoundError",
    "Problem",
    "PromotionError",
    "RegistryError",
    "RestoreResult",
    "SaveHandle",
    "SaveResult",
    "SavePolicy",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "UnsupportedStateError",
    "VerifyReport",
    "gc",
    "open_store",
]
