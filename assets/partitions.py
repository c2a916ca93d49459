"""The one partitions definition. Keys are ckptflow's checkpoint names
(``ckptflow.format.layout.checkpoint_name``): ``<run>@<step>``. An instance that predates
that name holds its older partitions as ``<run>__step-<12-digit step>``: they keep their
history, are read as the same checkpoints (``partition_keys``) and are never added twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from dagster import AssetExecutionContext, DagsterInstance, DynamicPartitionsDefinition

from ckptflow.format import layout as fmt
from resources.dagster_private import delete_dynamic_partitions, sql_event_storage

# the partitions' name, for the instance's calls (``DynamicPartitionsDefinition.name`` is optional)
CHECKPOINTS_PARTITIONS = "checkpoints"
checkpoints_partitions = DynamicPartitionsDefinition(name=CHECKPOINTS_PARTITIONS)
DIGEST_TAG = "ckptflow/manifest_digest"  # the commit a run is about (see ``pin_commit``)
# The checkpoint a run is about, ``<run>@<step>``: the partition key, and the same for
# partitions an older instance holds under their former name, so the Runs list filters
# one checkpoint's runs by one tag.
CHECKPOINT_TAG = "checkpoint"


def checkpoint_key(run: str, step: int) -> str:
    return fmt.checkpoint_name(run, step)


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    return fmt.parse_checkpoint_name(key)


def partition_keys(instance: DagsterInstance) -> dict[tuple[str, int], str]:
    """(run, step) -> the ``checkpoints`` partition the instance holds for it, whichever
    name it was added under (a key that names no checkpoint is left out)."""
    keys: dict[tuple[str, int], str] = {}
    for key in instance.get_dynamic_partitions(CHECKPOINTS_PARTITIONS):
        try:
            ref = parse_checkpoint_key(key)
        except ValueError:
            continue
        if keys.get(ref) != checkpoint_key(*ref):  # the current name wins over a legacy one
            keys[ref] = key
    return keys


def in_step_order(keys: Iterable[str]) -> list[str]:
    """Checkpoint keys by (run, step): the order partitions are added in (and listed by
    the UI), which the strings do not sort in."""
    return sorted(keys, key=parse_checkpoint_key)


def checkpoint_tags(key: str) -> dict[str, str]:
    """``{"checkpoint": "<run>@<step>"}`` for a run about the checkpoint ``key``."""
    try:
        run, step = parse_checkpoint_key(key)
    except ValueError:  # not a checkpoint name: nothing shorter to say
        return {}
    return {CHECKPOINT_TAG: f"{run}@{step}"}


def pin_commit(context: AssetExecutionContext) -> Callable[[str], None]:
    """The run's ``on_commit`` (``ckptflow.lifecycle.per_checkpoint``): tags the run with
    the digest of the commit it is about to process, so a failure is recorded against
    that commit even if the step is committed again before the failure sensor looks.
    It also adds the short ``checkpoint`` tag to runs nobody tagged when requesting them
    (the automation sensors' runs, backfills, a launch from the UI)."""

    def pin(digest: str) -> None:
        wanted = {DIGEST_TAG: digest, **checkpoint_tags(context.partition_key)}
        missing = {k: v for k, v in wanted.items() if context.run.tags.get(k) != v}
        if missing:
            context.instance.add_run_tags(context.run.run_id, missing)

    return pin


DROP_BATCH = 500  # keys per DELETE statement (SQLite allows 32,766 bound parameters)


def drop_checkpoint_partitions(instance: DagsterInstance, keys: Sequence[str]) -> int:
    """Delete the ``checkpoints`` partitions among ``keys``, and any the instance holds
    for the same checkpoints under their former name (absent ones are skipped); returns
    how many were deleted.

    Dagster's public API deletes one partition per call, and on SQLite each call is a
    transaction of its own (about 20 ms: 10,000 expiries took minutes). On the SQL event
    storages Dagster ships this deletes ``DROP_BATCH`` keys per statement, through
    Dagster's private schema (``resources.dagster_private``, covered by
    ``test_partitions_are_dropped_in_batches_and_only_those_named`` in tests/dagster/test_jobs.py);
    any other storage gets the public call per key.
    """
    wanted = dict.fromkeys(keys)
    for key in keys:
        try:
            ref = parse_checkpoint_key(key)
        except ValueError:
            continue  # not a checkpoint name: only that key itself
        wanted.update(dict.fromkeys((checkpoint_key(*ref), fmt.legacy_checkpoint_name(*ref))))
    known = set(instance.get_dynamic_partitions(CHECKPOINTS_PARTITIONS))
    doomed = [key for key in wanted if key in known]
    storage = sql_event_storage(instance)
    if storage is None:
        for key in doomed:
            instance.delete_dynamic_partition(CHECKPOINTS_PARTITIONS, key)
        return len(doomed)
    for start in range(0, len(doomed), DROP_BATCH):
        delete_dynamic_partitions(storage, CHECKPOINTS_PARTITIONS, doomed[start : start + DROP_BATCH])
    return len(doomed)
