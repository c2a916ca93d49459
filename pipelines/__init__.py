"""Dagster layer: pipelines (filled in by the lifecycle issue)."""
