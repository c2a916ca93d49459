"""ckptflow: fast, verified, content-addressed checkpoints for PyTorch training.

The library has no Dagster dependency; the Dagster layer (assets/, sensors/,
pipelines/) is a thin orchestration shell over it. Every error ckptflow raises on
purpose derives from ``CkptflowError``; every one a caller can receive is defined in
``ckptflow.errors`` and importable from here. (``ckptflow.dcp.failures`` keeps two more that
carry a verdict out of DCP's load and never reach a caller; the command line reports
its ``UsageError`` itself.)

What needs torch (the ``Checkpointer`` and friends) is imported on first use, so the
``ckptflow`` command can list, verify and collect a store without paying for it.
"""

from typing import TYPE_CHECKING, Any

from ckptflow.errors import (
    CheckpointExistsError,
    CkptflowError,
    ColdObjectError,
    CorruptChunkError,
    DcpFormatError,
    EvaluatorError,
    ExpireError,
    FailedValidationError,
    HostMemoryError,
    InvalidNameError,
    LossyCopyError,
    ManifestError,
    MirrorError,
    NewerFormatError,
    NoValidCheckpointError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PartialRestoreError,
    PromotionError,
    RecordTooLargeError,
    RegistryError,
    RetentionError,
    StateMismatchError,
    StoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreUnavailableError,
    SymlinkError,
    UnsupportedStateError,
    WentPast,
)

# Loaded on first use: a training rank that imports ``ckptflow`` pays only for what it touches.
_LAZY = {
    "Alias": "ckptflow.catalog.selection",
    "Best": "ckptflow.catalog.selection",
    "Dataset": "ckptflow.format.lineage",
    "RunLineage": "ckptflow.format.lineage",
    "Warmup": "ckptflow.training.warmup",
    "WarmupLR": "ckptflow.training.warmup",
    "CheckpointInfo": "ckptflow.catalog.checkpoints",
    "Checkpointer": "ckptflow.training.checkpointer",
    "GCReport": "ckptflow.catalog.gc",
    "Manifest": "ckptflow.format.manifest",
    "PreemptionHandler": "ckptflow.training.preemption",
    "Problem": "ckptflow.catalog.listing",
    "RestoreResult": "ckptflow.training.restore",
    "SaveHandle": "ckptflow.training.checkpointer",
    "SavePolicy": "ckptflow.policy.save",
    "SaveResult": "ckptflow.training.checkpointer",
    "Store": "ckptflow.store",
    "VerifyReport": "ckptflow.catalog.checkpoints",
    "export_dcp": "ckptflow.interop.export",
    "export_safetensors": "ckptflow.interop.export",
    "import_checkpoint": "ckptflow.interop.importers",
    "model_metadata": "ckptflow.interop.export",
    "gc": "ckptflow.catalog.gc",
    "open_store": "ckptflow.store",
    "per_rank": "ckptflow.format.state_tree",
}

if TYPE_CHECKING:
    from ckptflow.catalog.checkpoints import CheckpointInfo, VerifyReport
    from ckptflow.catalog.gc import GCReport, gc
    from ckptflow.catalog.listing import Problem
    from ckptflow.catalog.selection import Alias, Best
    from ckptflow.format.lineage import Dataset, RunLineage
    from ckptflow.format.manifest import Manifest
    from ckptflow.format.state_tree import per_rank
    from ckptflow.interop.export import export_dcp, export_safetensors, model_metadata
    from ckptflow.interop.importers import import_checkpoint
    from ckptflow.policy.save import SavePolicy
    from ckptflow.store import Store, open_store
    from ckptflow.training.checkpointer import Checkpointer, SaveHandle, SaveResult
    from ckptflow.training.preemption import PreemptionHandler
    from ckptflow.training.restore import RestoreResult
    from ckptflow.training.warmup import Warmup, WarmupLR


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptflow' has no attribute {name!r}")


__all__ = [
    "Alias",
    "Best",
    "Dataset",
    "RunLineage",
    "Warmup",
    "WarmupLR",
    "CheckpointExistsError",
    "CheckpointInfo",
    "Checkpointer",
    "CkptflowError",
    "ColdObjectError",
    "CorruptChunkError",
    "DcpFormatError",
    "EvaluatorError",
    "ExpireError",
    "FailedValidationError",
    "GCReport",
    "InvalidNameError",
    "HostMemoryError",
    "LossyCopyError",
    "Manifest",
    "ManifestError",
    "MirrorError",
    "NewerFormatError",
    "NoValidCheckpointError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PartialRestoreError",
    "PreemptionHandler",
    "Problem",
    "PromotionError",
    "RecordTooLargeError",
    "RegistryError",
    "RetentionError",
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
    "WentPast",
    "VerifyReport",
    "export_dcp",
    "export_safetensors",
    "gc",
    "import_checkpoint",
    "model_metadata",
    "open_store",
    "per_rank",
]
