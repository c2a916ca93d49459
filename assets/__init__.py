"""Dagster layer: assets (filled in by the lifecycle issue)."""
