"""Dagster layer: ``ConfigurableResource``s wrapping the ckptflow library."""

from resources.evaluator import EvaluatorResource
from resources.store import ArchiveResource, CheckpointStoreResource, RegistryResource

__all__ = ["ArchiveResource", "CheckpointStoreResource", "EvaluatorResource", "RegistryResource"]
