"""Dagster layer: sensors (filled in by the lifecycle issue)."""
