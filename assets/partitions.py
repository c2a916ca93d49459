"""The one partitions definition, and the only place checkpoint keys are built or parsed.

A key is ``<run>__step-<12-digit step>``: run names cannot contain ``__`` (ckptflow
refuses them), so the split is unambiguous, and zero-padded steps sort in step order
in the UI.
"""

from __future__ import annotations

from dagster import DynamicPartitionsDefinition

from ckptflow import format as fmt

checkpoints_partitions = DynamicPartitionsDefinition(name="checkpoints")

_SEP = "__step-"


def checkpoint_key(run: str, step: int) -> str:
    return f"{fmt.validate_run(run)}{_SEP}{fmt.validate_step(step):0{fmt.STEP_DIGITS}d}"


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    run, sep, step = key.rpartition(_SEP)
    if not sep or len(step) != fmt.STEP_DIGITS or not step.isdigit():
        raise ValueError(f"partition key {key!r} is not '<run>{_SEP}<{fmt.STEP_DIGITS}-digit step>'")
    return fmt.validate_run(run), int(step)
