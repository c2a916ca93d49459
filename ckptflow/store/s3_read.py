"""Streamed S3 reads: a GET body read piece by piece into the caller's buffers
(``S3Store.get_into``) or through one reused buffer (``S3Store.scan``), never whole in
memory. A model file is many GB: read as one ``bytes`` it would need that much memory,
bounded by nothing but the object's own size.

The store's retries apply (``Object.attempts``): a body cut off while streaming is
retried like the request, and the retried GET resumes where the last whole piece ended
(``Range``), so a many-GB download cut off near its end does not fetch it all again, and
``consume`` sees every byte once, in order. That holds only if both GETs return the same
object: the resumed GET asks for the ETag already read (``If-Match``), and an object
replaced since fails the read (``StoreError``) rather than mix two objects. A store that
ignores ``Range`` (some S3-compatible servers and proxies answer 200 with the whole object)
is read on past the bytes already placed, which are not handed out again. Retries that
ran out having moved the read on start a fresh round of them: a connection that drops
every few hundred MB still finishes a many-GB file, and one that makes no progress fails
as any read does (``StoreUnavailableError``). What
``consume`` raises passes through as it is, neither retried nor renamed (a consumer's
``OSError`` is no network failure).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError, IncompleteReadError

from ckptflow.errors import ObjectTooLargeError, StoreError, StoreUnavailableError
from ckptflow.store.s3_retry import error_code, http_status

#: What to read, given the object's size: the views to fill, in order, each handed to
#: ``consume`` once whole; None to read nothing.
Plan = Callable[[int], Iterable[memoryview] | None]


@dataclass(frozen=True)
class Object:
    """One object as ``S3Store`` reads it: ``where`` (``s3://bucket/key``), ``get`` (one
    GetObject from a byte on, of that ETag if one is given: the response, its body unread)
    and ``attempts`` (a call run under the store's retries, what still fails turned into
    its errors)."""

    where: str
    get: Callable[[int, str | None], dict]
    attempts: Callable[[Callable[[], Any]], Any]


class _ConsumerFailed(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def get_into(
    obj: Object,
    buffers: Sequence[bytearray | memoryview],
    consume: Callable[[memoryview], None] | None,
    piece: int,
) -> tuple[int, str]:
    """``Store.get_into``: the buffers filled ``piece`` bytes at a time (a piece never spans
    two), only if the object's size is their total; (its size, its ETag)."""
    views = [memoryview(b).cast("B") for b in buffers]
    total, step = sum(len(v) for v in views), max(1, piece)

    def plan(size: int) -> Iterable[memoryview] | None:
        if size != total:
            return None
        return (view[start : start + step] for view in views for start in range(0, len(view), step))

    return _stream(obj, plan, consume)


def scan(obj: Object, buffer: memoryview, consume: Callable[[memoryview], None], limit: int | None) -> tuple[int, str]:
    """``Store.scan``: the object through ``buffer`` into ``consume``; one over ``limit``
    bytes is refused from its length header, before its body is read."""
    view = memoryview(buffer).cast("B")

    def plan(size: int) -> Iterable[memoryview]:
        if limit is not None and size > limit:
            raise ObjectTooLargeError(f"{obj.where} holds {size} bytes, more than the {limit} expected")
        return (view[: min(len(view), size - start)] for start in range(0, size, len(view)))

    return _stream(obj, plan, consume)


def _stream(obj: Object, plan: Plan, consume: Callable[[memoryview], None] | None) -> tuple[int, str]:
    """One GetObject, retried as the store retries reads (each retry resuming after the last
    whole piece), its body read into what ``plan`` gives for its size: (the object's size,
    its ETag)."""
    seen: dict[str, Any] = {"etag": None, "done": 0}  # across attempts: bytes placed (and consumed)

    def attempt() -> tuple[int, str]:
        resume = seen["done"]
        response = _get(obj, resume, seen["etag"])
        body = response["Body"]
        try:
            size, etag, at = _size_etag_and_start(obj, response, resume)
            if seen["etag"] not in (None, etag):
                raise _replaced(obj, seen["etag"], etag)
            pieces = plan(size)
            if pieces is None:
                return size, etag
            seen["etag"] = etag  # bytes of this object go out from here on
            offset = 0
            for part in pieces:
                if offset < resume:  # placed (and consumed) by an earlier attempt
                    if at < offset + len(part):  # a whole object's body: read past those bytes
                        _skip(body, offset + len(part) - at, at, size)
                        at = offset + len(part)
                    offset += len(part)
                    continue
                _fill(body, part, offset, size)
                offset += len(part)
                if consume is not None:
                    try:
                        consume(part)
                    except Exception as e:
                        raise _ConsumerFailed(e) from e
                seen["done"] = offset
            return size, etag
        finally:
            body.close()

    while True:
        before = seen["done"]
        try:
            return obj.attempts(attempt)
        except _ConsumerFailed as e:
            error: Exception = e.error
        except StoreUnavailableError:
            if seen["done"] > before:  # the retries ran out, but not without progress: a fresh round
                continue
            raise
        raise error  # outside the handler: the consumer's own error, with no retry machinery chained to it


def _get(obj: Object, resume: int, etag: str | None) -> dict:
    """The GET of an attempt: from ``resume`` on, of ``etag`` only, once bytes were placed."""
    try:
        return obj.get(resume, etag)
    except ClientError as e:
        if etag is not None and (error_code(e) == "PreconditionFailed" or http_status(e) == 412):
            raise _replaced(obj, etag, "another") from None
        raise


def _size_etag_and_start(obj: Object, response: dict, resume: int) -> tuple[int, str, int]:
    """The whole object's size, its ETag and the byte its body starts at: a resumed GET's
    ``Content-Range`` must start where it was asked to (``bytes <first>-<last>/<size>``), or
    the answer be the whole object (200, no ``Content-Range``: a store that ignores ``Range``)."""
    etag = str(response.get("ETag", ""))
    answered = str(response.get("ContentRange", ""))
    whole = not answered and response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200
    if not resume or whole:
        return int(response.get("ContentLength", 0)), etag, 0

    first, _, size = answered.removeprefix("bytes ").partition("/")
    if not first.startswith(f"{resume}-") or not size.isdigit():
        raise StoreError(f"{obj.where}: asked for its bytes from {resume} on, S3 answered {answered!r}; read it again")
    return int(size), etag, resume


def _replaced(obj: Object, before: str, now: str) -> StoreError:
    return StoreError(
        f"{obj.where} was replaced while it was read (ETag {before}, then {now}); "
        "nothing read from it can be trusted: read it again"
    )


def _skip(body: Any, count: int, offset: int, size: int) -> None:
    """``count`` bytes of ``body`` read and dropped, 1 MiB at a time."""
    scratch = memoryview(bytearray(min(count, 1 << 20)))
    while count:
        n = min(count, len(scratch))
        _fill(body, scratch[:n], offset, size)
        offset, count = offset + n, count - n


def _fill(body: Any, part: memoryview, offset: int, size: int) -> None:
    """``part`` filled from ``body``; a body that ends first was cut off (retried)."""
    got = 0
    while got < len(part):
        data = body.read(len(part) - got)
        if not data:
            raise IncompleteReadError(actual_bytes=offset + got, expected_bytes=size)
        part[got : got + len(data)] = data
        got += len(data)
