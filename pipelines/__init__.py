"""Dagster layer: the code location (definitions), jobs and schedules, the in-process driver, the demo."""
