"""Dagster layer: ``ConfigurableResource``s wrapping the ckptflow library.

``S3ArchiveResource`` is imported on first use (``resources.s3_archive``), so a code
location without an S3 archive never imports dagster-aws.
"""

from resources.archive import ArchiveResource, ArchiveTierResource
from resources.evaluator import EvaluatorResource
from resources.pricing import PricingResource
from resources.retention import RetentionResource
from resources.store import CheckpointStoreResource, RegistryResource

__all__ = [
    "ArchiveResource",
    "ArchiveTierResource",
    "CheckpointStoreResource",
    "EvaluatorResource",
    "PricingResource",
    "RegistryResource",
    "RetentionResource",
    "S3ArchiveResource",
]


def __getattr__(name: str):
    if name == "S3ArchiveResource":
        from resources.s3_archive import S3ArchiveResource

        return S3ArchiveResource
    raise AttributeError(f"module 'resources' has no attribute {name!r}")
