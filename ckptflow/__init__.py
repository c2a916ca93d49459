"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it. Every error ckptflow raises on
purpose derives from ``CkptflowError`` and is importable from here.
"""

from ckptflow.catalog import CheckpointInfo, Problem, VerifyReport
from ckptflow.checkpointer import Checkpointer, RestoreResult, SaveHandle, SaveResult
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
from ckptflow.tree import per_rank

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
