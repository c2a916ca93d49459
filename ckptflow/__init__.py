"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it.
"""

from ckptflow.catalog import CheckpointInfo, VerifyReport
from ckptflow.checkpointer import Checkpointer, RestoreResult, SaveHandle, SaveResult
from ckptflow.errors import (
    CheckpointExistsError,
    CkptflowError,
    CorruptChunkError,
    InvalidNameError,
    ManifestError,
    NoValidCheckpointError,
    UnsupportedStateError,
)
from ckptflow.gc import GCReport, gc
from ckptflow.policies import SavePolicy
from ckptflow.store import Store, open_store

__all__ = [
    "CheckpointExistsError", "CheckpointInfo", "Checkpointer", "CkptflowError", "CorruptChunkError",
    "GCReport", "InvalidNameError", "ManifestError", "NoValidCheckpointError", "RestoreResult",
    "SaveHandle", "SaveResult", "SavePolicy", "Store", "UnsupportedStateError", "VerifyReport",
    "gc", "open_store",
]
