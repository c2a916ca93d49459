"""Every use of Dagster's private API in this project, in one place.

Why private APIs at all: Dagster 1.13's public API lacks two things the lifecycle needs.

* Deleting many dynamic partitions. ``DagsterInstance.delete_dynamic_partition`` deletes
  one per call, and on SQLite each call is a transaction of its own (about 20 ms:
  10,000 expiries took minutes). On the SQL event storages Dagster ships (SQLite,
  PostgreSQL, MySQL) ``delete_dynamic_partitions`` deletes a batch per statement in the
  table ``delete_dynamic_partition`` itself deletes from (``DynamicPartitionsTable``),
  reaching the storage through ``SqlEventLogStorage`` (and the ``_storage`` attribute of
  the wrapper a ``storage:`` config puts around it).
* A partition's latest asset-check execution (``latest_check_passed``): what Dagster's
  own UI queries use (``get_latest_asset_check_execution_by_key`` with a
  ``PartitionKeyFilter``, ``AssetCheckExecutionRecordStatus``).

And one private detail the run-failure sensor reads: a raised ``Failure``'s message
reaches the event log prefixed with its private class path (``FAILURE_CLASS_PREFIX``),
which the run tag drops.

Each private name is imported inside the function that uses it, so a Dagster that moved
one fails that function, never the code location's load.

On a Dagster upgrade (the dagster==1.13.27 pin in pyproject.toml), check that each
import below still resolves, that ``DynamicPartitionsTable`` still has the columns
``partitions_def_name`` and ``partition``, that the storage wrapper still holds its
storages in ``_storage``, and that the prefix is still what a ``Failure`` step error
starts with; then run ``tests/dagster/test_jobs.py`` (batched partition drops, the
failure tag) and the end-to-end ``tests/dagster/test_daemon.py`` (check executions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dagster import AssetCheckKey, DagsterInstance

FAILURE_CLASS_PREFIX = "dagster._core.definitions.events.Failure: "


def sql_event_storage(instance: DagsterInstance) -> Any:
    """The instance's SQL event-log storage, or None for any other kind."""
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

    storage = instance.event_log_storage
    inner = getattr(getattr(storage, "_storage", None), "event_log_storage", None)  # behind `storage:` config
    for candidate in (storage, inner):
        if isinstance(candidate, SqlEventLogStorage):
            return candidate
    return None


def delete_dynamic_partitions(storage: Any, partitions_def_name: str, keys: Sequence[str]) -> None:
    """Delete ``keys`` of the dynamic partitions ``partitions_def_name`` in one statement
    (``storage``: what ``sql_event_storage`` returned)."""
    from dagster._core.storage.event_log.schema import DynamicPartitionsTable

    table = DynamicPartitionsTable.c
    with storage.index_connection() as conn:
        conn.execute(
            DynamicPartitionsTable.delete().where(
                (table.partitions_def_name == partitions_def_name) & table.partition.in_(list(keys))
            )
        )


def latest_check_passed(instance: DagsterInstance, check: AssetCheckKey, partition: str) -> bool | None:
    """Whether the latest execution of ``check`` on ``partition`` passed; None while it
    has none that finished (never run, or only planned)."""
    from dagster._core.event_api import PartitionKeyFilter
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [check], partition_filter=PartitionKeyFilter(key=partition)
    ).get(check)
    if latest is None or latest.status == AssetCheckExecutionRecordStatus.PLANNED:
        return None
    return latest.status == AssetCheckExecutionRecordStatus.SUCCEEDED
