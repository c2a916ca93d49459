"""Dagster layer: the landing sensor and the run-failure sensor."""

from sensors.failures import failure_sensor
from sensors.landing import landing_sensor, validation_job

__all__ = ["failure_sensor", "landing_sensor", "validation_job"]
