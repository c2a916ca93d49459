"""The one partitions definition. Keys are ckptflow's checkpoint names
(``ckptflow.format.checkpoint_name``): ``<run>__step-<12-digit step>``."""

from __future__ import annotations

from dagster import DynamicPartitionsDefinition

from ckptflow import format as fmt

checkpoints_partitions = DynamicPartitionsDefinition(name="checkpoints")


def checkpoint_key(run: str, step: int) -> str:
    return fmt.checkpoint_name(run, step)


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    return fmt.parse_checkpoint_name(key)
