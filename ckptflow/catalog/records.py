"""The one read of a small JSON record ckptflow keeps beside the checkpoints: recovery
records, lifecycle verdicts, the ledger of expired checkpoints.

Each of those readers used to ``json.loads(store.get(key))``: a multi-GB object was read
whole before anything looked at it, a deeply nested one raised ``RecursionError``, and one
that parsed was trusted in whatever shape it had, so a list where an object belongs, or a
string where a number belongs, surfaced as a ``TypeError`` far from the store (or as a
wrong figure). Here a record is refused unread above ``SMALL_RECORD_BYTES``, parsed within
the bounds every ckptflow record has (``format.sealed.parse_json``), and must be a JSON
object; the caller checks its fields and says what to do with a damaged one.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ckptflow.errors import ManifestError, ObjectTooLargeError, RecordTooLargeError
from ckptflow.format.sealed import parse_json
from ckptflow.store.base import Store

SMALL_RECORD_BYTES = 16 << 20  # a recovery record, a verdict or a ledger entry is a few KB


def read_object(store: Store, key: str, *, limit: int = SMALL_RECORD_BYTES) -> dict[str, Any]:
    """The JSON object at ``key``. ``RecordTooLargeError`` (unread) or ``ManifestError``
    naming the object when it is damaged; ``ObjectNotFoundError`` and store errors as raised."""
    where = f"{store.url}/{key}"
    try:
        blob = store.get_bounded(key, limit)
    except ObjectTooLargeError as e:
        raise RecordTooLargeError(f"{e}; no such ckptflow record is that large: it is damaged") from None
    return as_object(parse_json(blob, where), where)


def as_object(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ManifestError(f"{where} is a JSON {type(record).__name__}, not an object: the record is damaged")
    return record


def is_number(value: Any, *, minimum: float = -math.inf) -> bool:
    """A JSON number of at least ``minimum`` that is a finite float too: not a bool (``True``
    is 1 in Python), not NaN or infinity (which Python's JSON parser accepts), not an integer
    too large for a float (arithmetic and printing on it raise ``OverflowError``)."""
    if type(value) is int:
        return minimum <= value and abs(value) <= sys.float_info.max
    return type(value) is float and math.isfinite(value) and value >= minimum
