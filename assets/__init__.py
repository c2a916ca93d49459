"""Dagster layer: checkpoint assets and checks, the inventory, deployed models."""

from assets.checkpoints import archived, checkpoint, compressed, evaluation, integrity
from assets.costs import storage_cost
from assets.inventory import checkpoint_inventory, retention_plan
from assets.metrics import recovery_metrics
from assets.models import deployed_model
from assets.partitions import checkpoint_key, checkpoints_partitions, parse_checkpoint_key

PARTITIONED = [checkpoint, evaluation, compressed, archived]
ALL_ASSETS = [*PARTITIONED, checkpoint_inventory, retention_plan, recovery_metrics, storage_cost, deployed_model]
ALL_CHECKS = [integrity]

__all__ = [
    "ALL_ASSETS",
    "ALL_CHECKS",
    "PARTITIONED",
    "archived",
    "checkpoint",
    "checkpoint_inventory",
    "checkpoint_key",
    "checkpoints_partitions",
    "compressed",
    "deployed_model",
    "evaluation",
    "integrity",
    "parse_checkpoint_key",
    "recovery_metrics",
    "retention_plan",
    "storage_cost",
]
