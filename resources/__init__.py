"""Dagster layer: ``ConfigurableResource``s wrapping the ckptflow library."""

from resources.archive import ArchiveResource, ArchiveTierResource, S3ArchiveResource
from resources.evaluator import EvaluatorResource
from resources.store import CheckpointStoreResource, RegistryResource

__all__ = [
    "ArchiveResource",
    "ArchiveTierResource",
    "CheckpointStoreResource",
    "EvaluatorResource",
    "RegistryResource",
    "S3ArchiveResource",
]
