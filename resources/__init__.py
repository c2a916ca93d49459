"""Dagster layer: ``ConfigurableResource``s wrapping the ckptflow library."""

from resources.evaluator import EvaluatorResource
from resources.store import (
    ArchiveResource, ArchiveTierResource, CheckpointStoreResource, RegistryResource, S3ArchiveResource,
)

__all__ = [
    "ArchiveResource", "ArchiveTierResource", "CheckpointStoreResource", "EvaluatorResource", "RegistryResource",
    "S3ArchiveResource",
]
