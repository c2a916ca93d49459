"""Sealed JSON records: a record carries the sha256 of its own canonical JSON.

A flipped byte anywhere in a manifest or rank record is detected before it is
trusted. Bounds keep a hostile or broken record from making a reader allocate without
limit: its size is capped before it is parsed, its nesting depth after.

``Fields`` reads typed fields out of a parsed record, raising one ``ManifestError``
that names the record for whatever is missing or of the wrong type.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ckptflow.errors import ManifestError, NewerFormatError
from ckptflow.format import layout as fmt

MAX_RECORD_BYTES = 1 << 30  # a manifest listing 10 TB in 8 MiB chunks is ~150 MiB
MAX_DEPTH = 128  # JSON nesting; a real state dict is a handful of levels deep
LAST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z: the last second datetime can hold
_SHA256_HEX = re.compile("[0-9a-f]{64}")


# ---- sealing -------------------------------------------------------------------------
def canonical(obj: Any) -> bytes:
    """The bytes a record's checksum covers: compact JSON in the record's own key order
    (the order it was written in, which parsing keeps)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


def seal(record: Mapping[str, Any]) -> bytes:
    """Serialize ``record`` followed by its own checksum: the canonical JSON of
    ``{**record, "checksum": ...}``, made from the body's by appending the last key
    rather than by encoding everything twice."""
    body = canonical({k: v for k, v in record.items() if k != "checksum"})
    seal_field = b'"checksum":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'
    return body[:-1] + (b"," if len(body) > 2 else b"") + seal_field


def json_problem(value: Any, where: str) -> str | None:
    """Why ``value`` cannot be stored as JSON exactly (None if it can): only dicts with
    string keys, lists, str, int, float, bool and None, no deeper than ``MAX_DEPTH``."""
    stack: list[tuple[Any, str, int]] = [(value, where, 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{path} is nested deeper than {MAX_DEPTH} levels"
        if isinstance(node, dict):
            for key, child in node.items():
                if not isinstance(key, str):
                    return f"{path} has the key {key!r} of type {type(key).__name__}; JSON keys are strings"
                stack.append((child, f"{path}[{key!r}]", depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(node))
        elif node is not None and type(node) not in (str, int, float, bool):
            hint = " (convert it with float() or int(), e.g. loss.item())" if hasattr(node, "item") else ""
            return f"{path} is a {type(node).__module__}.{type(node).__name__}, not a JSON value{hint}"
    return None


def _depth_ok(obj: Any, limit: int) -> bool:
    """Level by level, descending into containers only (plain loops: a generator per
    container cost three times as much on a manifest of 2,400 tensors)."""
    level, depth = [obj], 1
    while level:
        if depth > limit:
            return False
        below: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
        level, depth = below, depth + 1
    return True


def _sealed_body(blob: bytes, claimed: Any) -> bytes | None:
    """The bytes ``seal`` hashed, cut from ``blob`` itself when it ends as ``seal`` ends a
    record (``,"checksum":"<claimed>"}``): so the checksum covers exactly the bytes that
    were parsed, and nothing is encoded again; None for any other layout. (A body that is
    not canonical, say with a key twice, is then accepted where its hash matches: the seal
    detects damage, which changes the hash, and was never proof of who wrote a record.)"""
    if not isinstance(claimed, str) or _SHA256_HEX.fullmatch(claimed) is None:
        return None
    tail = b',"checksum":"' + claimed.encode() + b'"}'
    return blob[: -len(tail)] + b"}" if blob.endswith(tail) else None


def parse_json(blob: bytes, where: str) -> Any:
    """Any ckptflow record's JSON, sealed or not, within the size and depth bounds: one rule
    for every reader, so a truncated, hostile or deeply nested record is one ``ManifestError``
    naming ``where`` (damage), never a ``ValueError`` or ``RecursionError`` from the parser."""
    if len(blob) > MAX_RECORD_BYTES:
        raise ManifestError(f"{where} is {len(blob)} bytes, more than any ckptflow record ({MAX_RECORD_BYTES})")
    try:
        record = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the record is corrupt") from None
    except RecursionError:
        raise ManifestError(f"{where} is nested deeper than any ckptflow record; it is corrupt or hostile") from None
    if type(record) in (dict, list) and not _depth_ok(record, MAX_DEPTH):
        raise ManifestError(f"{where} is nested deeper than {MAX_DEPTH} levels; it is corrupt or hostile")
    return record


def unseal(blob: bytes, where: str) -> dict:
    """Parse and verify a sealed record; ``ManifestError`` naming ``where`` otherwise, or
    ``NewerFormatError`` for a whole record of a format newer than this ckptflow reads."""
    record = parse_json(blob, where)
    if not isinstance(record, dict) or "checksum" not in record:
        raise ManifestError(f"{where} has no checksum field; it is not a ckptflow record")
    claimed = record.pop("checksum")
    as_sealed = _sealed_body(blob, claimed)
    actual = "" if as_sealed is None else hashlib.sha256(as_sealed).hexdigest()
    if as_sealed is None or actual != claimed:  # written another way: the checksum covers its canonical form
        actual = hashlib.sha256(canonical(record)).hexdigest()
    if claimed != actual:
        # records written before key order was kept were sealed over sorted keys
        legacy = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
        if claimed != hashlib.sha256(legacy).hexdigest():
            raise ManifestError(f"{where} fails its checksum (stored {str(claimed):.80}, computed {actual})")
    version = record.get("format_version")
    if type(version) is not int or version not in fmt.READABLE_FORMATS:  # true == 1 and 2.0 == 2 in Python
        reads = ", ".join(map(str, fmt.READABLE_FORMATS))
        if type(version) is int and version > max(fmt.READABLE_FORMATS):
            raise NewerFormatError(  # sealed whole by a newer writer: not damage
                f"{where} was written by a newer ckptflow (format_version {version}; this one reads {reads}): "
                "upgrade ckptflow to read it"
            )
        raise ManifestError(
            f"{where} has format_version {version!r}, which no ckptflow writes (this one reads {reads})"
        )
    return record


# ---- field checks --------------------------------------------------------------------
class Fields:
    """Typed field access that raises one ``ManifestError`` naming the record."""

    def __init__(self, where: str):
        self.where = where

    def bad(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where} {what}; it is malformed")

    def _get(self, doc: Mapping, name: str, *, optional: bool) -> Any:
        if name not in doc and not optional:
            raise self.bad(f"lacks field {name!r}")
        return doc.get(name)

    def integer(self, doc: Mapping, name: str, *, minimum: int = 0, optional: bool = False) -> Any:
        value = self._get(doc, name, optional=optional)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.bad(f"has field {name!r} = {value!r}, not an integer >= {minimum}")
        return value

    def timestamp(self, doc: Mapping, name: str) -> float:
        """Seconds since the epoch, a time every tool can print (``datetime`` and
        ``time.localtime`` overflow past the year 9999)."""
        value = self._get(doc, name, optional=False)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= LAST_TIME:
            raise self.bad(f"has field {name!r} = {value!r}, not a time between 1970 and 9999")
        return float(value)

    def string(self, doc: Mapping, name: str, *, optional: bool = False) -> Any:
        value = self._get(doc, name, optional=optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.bad(f"has field {name!r} of type {type(value).__name__}, not a string")
        return value

    def mapping(self, doc: Mapping, name: str) -> dict:
        value = self._get(doc, name, optional=False)
        if not isinstance(value, dict):
            raise self.bad(f"has field {name!r} of type {type(value).__name__}, not an object")
        return value

    def ints(self, value: Any, what: str, name: str) -> tuple[int, ...]:
        """``value`` as a tuple of non-negative integers; else the error names it as
        ``what`` ``name`` (put together only then: a manifest has thousands of these)."""
        if type(value) is list:  # parsed JSON: exact types (``type(True) is bool``, not int)
            for v in value:
                if type(v) is not int or v < 0:
                    break
            else:
                return tuple(value)
        raise self.bad(f"has {what} {name!r} {value!r}, not a list of non-negative integers")

    def dtype(self, value: Any, what: str, name: str) -> str:
        if type(value) is not str or value not in fmt.DTYPE_SIZES:
            raise ManifestError(
                f"{self.where}: {what} {name!r} names unknown dtype {value!r}; was it written by a newer ckptflow or "
                "torch?"
            )
        return value
