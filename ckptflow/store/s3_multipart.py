"""Multipart uploads for ``S3Store``: an object at or above the store's threshold is sent
in ``part_size`` parts, each with its own CRC32, and completed under the put's condition.

Split from ``ckptflow.store.s3`` because a multipart upload is a protocol of its own
(create, parts, complete, and an abort on any failure, so no billed, invisible parts stay
behind) where every other operation of the store is one request. The store hands in its
client and its retrying request runner, so retries and errors are the store's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ckptflow.store.s3_body import BuffersReader, crc32_b64

MAX_PARTS = 10_000  # S3 refuses a part numbered above this, once every part before it was sent


def parts_of(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``size``-byte parts of the concatenated buffers (the last may be shorter), each as
    views of the buffers: a multipart upload copies nothing."""
    part: list[memoryview] = []
    filled = 0
    for view in views:
        while len(view):
            take = size - filled
            part.append(view[:take])
            filled += len(view[:take])
            view = view[take:]
            if filled == size:
                yield part
                part, filled = [], 0
    if part:
        yield part


def upload_in_parts(
    client: Any,
    bucket: str,
    full_key: str,
    views: list[memoryview],
    *,
    part_size: int,
    extra: dict,
    condition: dict,
    passthrough: tuple[str, ...],
    attempts: Callable[..., Any],
) -> None:
    """Upload ``views`` to ``full_key`` in ``part_size`` parts, each with its own CRC32,
    and complete under ``condition`` (``passthrough``: the error codes of its refusal,
    which reach the caller as the ClientError). Any failure aborts the upload, so no
    billed, invisible parts stay behind (a process killed mid-upload can leave some: a
    bucket lifecycle rule "abort incomplete multipart uploads after N days" covers that).
    ``attempts(op, attempt, passthrough=())``: the store's runner of one request with
    retries (``S3Store._attempts`` for this object). An object over ``MAX_PARTS`` parts of
    ``part_size`` is sent in fewer, larger parts."""
    part_size = max(part_size, -(-sum(len(v) for v in views) // MAX_PARTS))
    upload = attempts(
        "CreateMultipartUpload",
        lambda: client.create_multipart_upload(Bucket=bucket, Key=full_key, ChecksumAlgorithm="CRC32", **extra),
    )["UploadId"]
    try:
        done = []
        for number, piece in enumerate(parts_of(views, part_size), start=1):
            checksum = crc32_b64(piece)
            etag = attempts("UploadPart", _part(client, bucket, full_key, upload, number, piece, checksum))["ETag"]
            done.append({"PartNumber": number, "ETag": etag, "ChecksumCRC32": checksum})
        attempts(
            "CompleteMultipartUpload",
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=full_key, UploadId=upload, MultipartUpload={"Parts": done}, **condition
            ),
            passthrough,
        )
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=full_key, UploadId=upload)
        except Exception:  # the original failure is the one to report
            pass
        raise


def _part(
    client: Any, bucket: str, full_key: str, upload: str, number: int, piece: list[memoryview], checksum: str
) -> Callable[[], Any]:
    """One attempt at uploading part ``number``: a fresh stream over its buffers each time."""

    def attempt() -> Any:
        return client.upload_part(
            Bucket=bucket,
            Key=full_key,
            UploadId=upload,
            PartNumber=number,
            Body=BuffersReader(piece),
            ContentLength=sum(len(v) for v in piece),
            ChecksumCRC32=checksum,
        )

    return attempt
