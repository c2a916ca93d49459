"""Dagster layer: resources (filled in by the lifecycle issue)."""
