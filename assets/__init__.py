"""Dagster layer: checkpoint assets and checks, the inventory, deployed models."""

from assets import maturity  # noqa: F401  (first: filters the warnings of the beta/preview APIs we opt into)
from assets.advice import checkpoint_advice, interval_near_optimum
from assets.checkpoints import INTEGRITY_KEY, archived, checkpoint, compressed, evaluation
from assets.costs import storage_cost
from assets.freshness import RPO_FRESHNESS_KEY, rpo_freshness
from assets.inventory import checkpoint_inventory, retention_plan
from assets.metrics import recovery_metrics
from assets.models import deployed_model
from assets.partitions import checkpoint_key, checkpoints_partitions, parse_checkpoint_key
from assets.recoverability import recoverability

PARTITIONED = [checkpoint, evaluation, compressed, archived]
ALL_ASSETS = [
    *PARTITIONED,
    checkpoint_inventory,
    retention_plan,
    recovery_metrics,
    recoverability,
    storage_cost,
    checkpoint_advice,
    deployed_model,
]
ALL_CHECKS = [rpo_freshness, interval_near_optimum]

__all__ = [
    "ALL_ASSETS",
    "ALL_CHECKS",
    "INTEGRITY_KEY",
    "PARTITIONED",
    "RPO_FRESHNESS_KEY",
    "archived",
    "checkpoint_advice",
    "checkpoint",
    "checkpoint_inventory",
    "checkpoint_key",
    "checkpoints_partitions",
    "compressed",
    "deployed_model",
    "evaluation",
    "interval_near_optimum",
    "parse_checkpoint_key",
    "recoverability",
    "recovery_metrics",
    "retention_plan",
    "rpo_freshness",
    "storage_cost",
]
