"""How ``S3Store`` lists a bucket fast: botocore's time parsing swapped for the standard
library's, and the paginated ListObjectsV2 walk that turns pages into ``ObjectInfo``.

A store with thousands of checkpoints lists tens of thousands of objects, each with a
time to parse. Kept apart from ``S3Store`` so that module holds reads, writes and retries.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ckptflow.store.base import ObjectInfo


def parse_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser for the ISO 8601 times S3 lists objects with, parsed by
    the standard library: botocore's default (dateutil) costs more than the rest of a
    10,000-object listing together. Anything else goes to botocore's own parser."""
    if isinstance(value, str) and value.endswith("Z") and "T" in value:
        try:
            return datetime.fromisoformat(value[:-1]).replace(tzinfo=timezone.utc)
        except ValueError:
            pass
    from botocore.utils import parse_timestamp as general

    return general(value)


def fast_times_session() -> Any:
    """A new botocore session whose responses parse times with ``parse_timestamp``."""
    import botocore.session

    session = botocore.session.get_session()
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
    return session


def list_objects(
    client: Any, bucket: str, root: str, prefix: str, *, delimiter: str, start_after: str
) -> list[ObjectInfo]:
    """Every object under ``prefix`` (keys relative to the store's ``root`` folder of
    ``bucket``), sorted by key, from every page of one ListObjectsV2 walk; with a
    ``delimiter``, what lies below it under one name is one entry (S3's CommonPrefixes,
    size 0); with ``start_after``, only the keys after it. Keys ending in '/' (the folder
    markers of the S3 console and of tools that mount a bucket) are left out: no ckptflow
    key ends so, and a directory is no object on a local store either."""
    base = f"{root}/" if root else ""
    kwargs: dict[str, Any] = {"Prefix": base + prefix.rstrip("/") + "/" if prefix else base}
    if delimiter:
        kwargs["Delimiter"] = delimiter
    if start_after:
        kwargs["StartAfter"] = base + start_after
    found: list[ObjectInfo] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, **kwargs):
        found += [
            ObjectInfo(o["Key"][len(base) :], int(o["Size"]), o["LastModified"].timestamp(), o.get("ETag", ""))
            for o in page.get("Contents", ())
            if not o["Key"].endswith("/")  # a folder marker (console, s3fs): a directory, as on disk, not an object
        ]
        found += [ObjectInfo(p["Prefix"][len(base) :], 0, 0.0) for p in page.get("CommonPrefixes", ())]
    return sorted(found, key=lambda info: info.key)
