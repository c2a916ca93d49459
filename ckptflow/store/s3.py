"""S3 backend: ``s3://bucket/prefix`` (AWS, or any S3-compatible store via an endpoint URL).

S3 gives the two guarantees the commit protocol needs without temp files: an object
appears whole or not at all (also a multipart upload, which becomes visible only at
``CompleteMultipartUpload``), and ``If-None-Match: *`` makes a put create-only, so two
writers can never both commit one manifest and a 412 on a chunk simply means dedup.
Every upload carries a checksum (``s3_body``: CRC32 for chunks, SHA-256 for small
objects) so S3 itself refuses bytes damaged on the way; bodies are streamed from the
caller's buffers, not joined into a copy.

Retries (``s3_retry``): transient failures are retried per call, ``max_attempts`` in
all; one that outlasts them is ``StoreUnavailableError``, any other final failure
``StoreError``, each naming the operation, ``s3://bucket/key``, the attempts made and
the last failure. One boto3 client is shared by all threads (clients are thread-safe;
only sessions are not, so none is kept).
"""

from __future__ import annotations

import builtins
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ckptflow.errors import ObjectNotFoundError, ObjectTooLargeError, StoreError, StoreUnavailableError
from ckptflow.store import s3_read, s3_retry
from ckptflow.store.base import Buffers, ObjectInfo, Store, as_buffers, validate_key
from ckptflow.store.s3_body import BuffersReader, checksum_header, crc32_b64, sha256_b64
from ckptflow.store.s3_listing import fast_times_session, list_objects
from ckptflow.store.s3_multipart import upload_in_parts
from ckptflow.store.s3_retry import AttemptsExhausted, Retry, botocore_config, error_code, http_status

ENDPOINT_ENV = "CKPTFLOW_S3_ENDPOINT_URL"
_NOT_FOUND = ("404", "NoSuchKey", "NotFound")
_EXISTS = ("412", "PreconditionFailed", "409", "ConditionalRequestConflict")
COLD_CLASSES = ("GLACIER", "DEEP_ARCHIVE")  # classes whose objects need a restore before a read


def _byte_views(data: Buffers) -> list[memoryview]:
    return [memoryview(p).cast("B") for p in as_buffers(data)]


class S3Store(Store):
    can_thaw = True
    compare_and_swap = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        storage_class: str | None = None,
        multipart_threshold: int = 64 << 20,
        part_size: int = 16 << 20,
        max_attempts: int = 10,
        retry: Retry | None = None,
        pool_connections: int = 128,
    ):
        if not bucket:
            raise ValueError("an S3 store needs a bucket name")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.storage_class = storage_class
        self.writes_cold = storage_class in COLD_CLASSES
        self.multipart_threshold, self.part_size = int(multipart_threshold), int(part_size)
        self.retry = retry or Retry(max_attempts=max(1, int(max_attempts)))
        if client is None:
            import boto3

            # A private session: boto3's default one is not safe to share between threads
            # that open stores concurrently; the client it makes is.
            client = boto3.session.Session(botocore_session=fast_times_session()).client(
                "s3",
                endpoint_url=endpoint_url or os.environ.get(ENDPOINT_ENV) or None,  # else AWS_ENDPOINT_URL / AWS
                region_name=region,
                config=botocore_config(pool_connections),
            )
        self.client = client
        self._bucket_seen = False  # HeadBucket found the bucket (``_bucket_exists``)

    def metadata_store(self) -> S3Store:
        """Manifests and rank records of a cold store go in the default class, so they
        stay listable and readable (only chunks, the bulk of the bytes, go cold)."""
        if not self.writes_cold:
            return self
        return S3Store(
            self.bucket,
            self.prefix,
            client=self.client,
            multipart_threshold=self.multipart_threshold,
            part_size=self.part_size,
            retry=self.retry,
        )

    # ---- plumbing ----------------------------------------------------------------------
    def _key(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key) if key else self.prefix}"

    def _call(self, op: str, key: str, fn: Callable[..., Any], passthrough: tuple[str, ...] = (), **kwargs: Any) -> Any:
        """One S3 call with retries; map not-found and cold objects, let ``passthrough``
        error codes through as the ClientError (a caller's expected answer)."""
        return self._attempts(op, key, lambda: fn(Bucket=self.bucket, **kwargs), passthrough)

    def _attempts(self, op: str, key: str, attempt: Callable[[], Any], passthrough: tuple[str, ...] = ()) -> Any:
        """Run ``attempt`` under ``self.retry`` and turn what still fails into our errors."""
        try:
            return self.retry.call(attempt)
        except AttemptsExhausted as e:
            raise StoreUnavailableError(
                f"S3 {op} of {self._where(key)} failed after {e.attempts} attempts: "
                f"{error_code(e.last) or type(e.last).__name__}: {e.last}"
            ) from e.last
        except ClientError as e:
            code = error_code(e)
            if code in passthrough:
                raise
            if code == "NoSuchBucket" or (http_status(e) == 404 and code != "NoSuchKey" and not self._bucket_exists()):
                raise StoreError(  # also a 404, yet never a missing object (a chunk, a lock, a manifest)
                    f"S3 {op} of {self._where(key)} failed: the bucket {self.bucket} does not exist (or not at "
                    "this endpoint): check the bucket name in the store URL and the endpoint, or create it"
                ) from None
            if code in _NOT_FOUND or http_status(e) == 404:
                raise ObjectNotFoundError(f"{self._where(key)} does not exist") from None
            if code == "InvalidObjectState":
                raise s3_retry.cold_object_error(self.url, self._where(key), key, e) from None
            raise StoreError(f"S3 {op} of {self._where(key)} failed: {code or http_status(e)}: {e}") from e
        except (BotoCoreError, OSError) as e:
            raise StoreError(f"S3 {op} of {self._where(key)} failed: {type(e).__name__}: {e}") from e

    def _bucket_exists(self) -> bool:
        """Asked (HeadBucket, once per store) at the first 404 that does not say what is missing:
        a HEAD's answer has no body. Anything but a 404 counts as yes: the call's 404 stands."""
        if not self._bucket_seen:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except (BotoCoreError, ClientError, OSError) as e:
                if http_status(e) == 404:
                    return False
                if not isinstance(e, ClientError):
                    return True  # no answer: asked again at the next such 404
            self._bucket_seen = True
        return True

    # ---- reads -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_bounded(key, None)

    def get_bounded(self, key: str, limit: int | None) -> bytes:
        return self._fetch(key, limit)[0]

    def _fetch(
        self, key: str, limit: int | None, passthrough: tuple[str, ...] = (), **kwargs: Any
    ) -> tuple[bytes, dict]:
        """One GetObject with its body, and the response: the body is read inside the attempt,
        so one cut off while streaming is retried like the request (and what outlasts the
        retries is ``StoreUnavailableError``, not damage); an object over ``limit`` is
        refused from its length header, before the body is read."""

        def attempt() -> tuple[bytes, dict]:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)
            size = int(response.get("ContentLength", 0))
            if limit is not None and size > limit:
                response["Body"].close()
                raise ObjectTooLargeError(f"{self._where(key)} holds {size} bytes, more than the {limit} expected")
            return response["Body"].read(), response

        return self._attempts("GetObject", key, attempt, passthrough)

    def read_head(self, key: str, size: int) -> bytes:
        """A ranged GET: a chunk's header without its payload. S3 refuses any range of an
        empty object (416 InvalidRange), whose head is its whole (empty) self, as a local
        store reads it: what that object is worth is for the caller's checks to say."""
        try:
            return self._fetch(key, None, ("InvalidRange",), Range=f"bytes=0-{max(0, size - 1)}")[0][:size]
        except ClientError:  # only InvalidRange gets here
            return b""

    def get_into(
        self,
        key: str,
        buffers: Sequence[bytearray | memoryview],
        *,
        consume: Callable[[memoryview], None] | None = None,
        piece: int = 256 << 10,
    ) -> tuple[int, str]:
        """``Store.get_into`` streamed (``s3_read``): the GET body goes into the buffers piece
        by piece, never whole into memory of its own; the version is the ETag. Restore never
        calls it here (``cheap_reread`` is False: it fetches and decodes each chunk once)."""
        return s3_read.get_into(self._object(key), buffers, consume, piece)

    def scan(
        self, key: str, buffer: memoryview, consume: Callable[[memoryview], None], *, limit: int | None = None
    ) -> tuple[int, str]:
        """``Store.scan`` streamed through ``buffer`` (``s3_read``): what a model download
        hashes and writes as it arrives, holding one buffer of it."""
        return s3_read.scan(self._object(key), buffer, consume, limit)

    def _object(self, key: str) -> s3_read.Object:
        def get(start: int, etag: str | None) -> dict:
            resume = {"Range": f"bytes={start}-", "IfMatch": etag} if start and etag else {}
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **resume)

        return s3_read.Object(self._where(key), get, lambda attempt: self._attempts("GetObject", key, attempt))

    def stat(self, key: str) -> ObjectInfo:
        head = self._call("HeadObject", key, self.client.head_object, Key=self._key(key))
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp(), head.get("ETag", ""))

    def list(self, prefix: str, *, recursive: bool = True) -> Iterator[ObjectInfo]:
        return self._list(prefix, "" if recursive else "/", "")

    def list_after(self, prefix: str, start_after: str = "", *, roll_up: str = "") -> Iterator[ObjectInfo]:
        return self._list(prefix, roll_up, start_after)

    def _list(self, prefix: str, delimiter: str, start_after: str) -> Iterator[ObjectInfo]:
        if prefix:
            validate_key(prefix.rstrip("/"))
        yield from self._attempts(  # a page that fails restarts the listing
            "ListObjectsV2",
            prefix.rstrip("/"),
            lambda: list_objects(
                self.client, self.bucket, self.prefix, prefix, delimiter=delimiter, start_after=start_after
            ),
        )

    # ---- writes ------------------------------------------------------------------------
    def put_if_absent(self, key: str, data: Buffers) -> bool:
        """Create-only put. A 412/409 means someone else's object is there: False.

        If a retried attempt had in fact succeeded before its response was lost, the
        retry sees 412 on our own object; identical content there (its SHA-256, or the
        MD5 ETag where the store keeps no checksum) counts as ours, so a commit whose
        response was lost is not mistaken for a second writer's.
        """
        views = _byte_views(data)
        for attempt in range(3):
            try:
                self._upload(key, views, create_only=True)
                return True
            except ClientError as e:
                if error_code(e) not in _EXISTS:
                    raise
                # 409: a concurrent conditional write was in flight; it may yet fail, so ask again
                if error_code(e) not in ("409", "ConditionalRequestConflict") or attempt == 2:
                    break
        if sum(len(v) for v in views) >= self.multipart_threshold:
            return False  # a composite checksum: cannot compare cheaply
        try:
            head = self._call("HeadObject", key, self.client.head_object, Key=self._key(key), ChecksumMode="ENABLED")
        except ObjectNotFoundError:  # deleted again in between: it was not ours
            return False
        if head.get("ChecksumSHA256"):
            return head["ChecksumSHA256"] == sha256_b64(views)
        if head.get("ChecksumCRC32"):  # an object of chunk size: its key is its content's address
            return head["ChecksumCRC32"] == crc32_b64(views) and head.get("ContentLength") == sum(len(v) for v in views)
        md5 = hashlib.md5(usedforsecurity=False)  # a single-part ETag (stores without checksums)
        for view in views:
            md5.update(view)
        return head.get("ETag", "").strip('"') == md5.hexdigest()

    def replace(self, key: str, data: Buffers) -> None:
        """A plain put: S3 swaps the whole object atomically (readers see old or new)."""
        self._upload(key, _byte_views(data), create_only=False)

    def _upload(self, key: str, views: builtins.list[memoryview], *, create_only: bool) -> None:
        extra: dict[str, Any] = {"StorageClass": self.storage_class} if self.storage_class else {}
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        size = sum(len(v) for v in views)
        if size >= self.multipart_threshold:
            return upload_in_parts(
                self.client,
                self.bucket,
                self._key(key),
                views,
                part_size=self.part_size,
                extra=extra,
                condition=condition,
                passthrough=_EXISTS,
                attempts=lambda op, attempt, passthrough=(): self._attempts(op, key, attempt, passthrough),
            )
        checksum = checksum_header(views)

        def put() -> Any:  # a fresh stream per attempt: a retry starts at its first byte
            return self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Body=BuffersReader(views),
                ContentLength=size,
                **checksum,
                **extra,
                **condition,
            )

        self._attempts("PutObject", key, put, passthrough=_EXISTS)

    def delete(self, key: str) -> None:
        self._call("DeleteObject", key, self.client.delete_object, Key=self._key(key))

    def touch(self, key: str) -> None:
        """Copy the object onto itself to refresh LastModified (GC's grace period restarts).

        S3 has no utime, so this is a server-side copy: no bytes cross the network, but
        each touch is billed as a PUT-class request (an incremental save touches every
        chunk it reuses), plus a retrieval in an infrequent-access class. The copy takes
        the store's storage class (STANDARD when none is set); a Glacier / Deep Archive
        object cannot be copied until thawed (``ColdObjectError``). Objects above 5 GiB
        would need a multipart copy; ckptflow's chunks are far smaller.
        """
        full = self._key(key)
        extra: dict[str, Any] = {"StorageClass": self.storage_class} if self.storage_class else {}
        self._call(
            "CopyObject",
            key,
            self.client.copy_object,
            Key=full,
            ChecksumAlgorithm="SHA256",
            CopySource={"Bucket": self.bucket, "Key": full},
            MetadataDirective="REPLACE",
            **extra,
        )

    def request_thaw(self, key: str, *, days: int = 1, tier: str = "Standard") -> bool:
        """Ask S3 to restore a cold object for ``days``; False if it is not in a cold
        class (nothing to do) or a restore is already under way."""
        try:
            self._call(
                "RestoreObject",
                key,
                self.client.restore_object,
                Key=self._key(key),
                passthrough=("InvalidObjectState", "RestoreAlreadyInProgress"),
                RestoreRequest={"Days": int(days), "GlacierJobParameters": {"Tier": tier}},
            )
        except ClientError:  # only the passthrough codes get here
            return False
        return True

    # ---- compare-and-swap: conditional puts on the ETag ------------------------------------
    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        body, response = self._fetch(key, limit)
        return body, str(response["ETag"])

    def version_and_size(self, key: str) -> tuple[str, int]:
        info = self.stat(key)  # one HeadObject: its ETag (GetObject's, same quotes) and the length of that version
        return info.version, info.size

    def delete_if(self, key: str, expected: str) -> bool:
        """``DeleteObject`` with ``If-Match: <ETag>``: S3 refuses it (412) if the object
        changed since it was read, and answers 404 if it is gone."""
        try:
            self._call(
                "DeleteObject",
                key,
                self.client.delete_object,
                passthrough=_EXISTS,
                Key=self._key(key),
                IfMatch=expected,
            )
        except (ClientError, ObjectNotFoundError):  # changed (412, 409) or gone: nothing deleted by this call
            return False
        return True

    def replace_if(self, key: str, data: Buffers, expected: str | None) -> bool:
        """``If-Match: <ETag>`` (or ``If-None-Match: *`` to create): S3 refuses the put
        with 412 if the object changed, 409 if a concurrent conditional write won."""
        body = b"".join(_byte_views(data))
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            self._call(
                "PutObject",
                key,
                self.client.put_object,
                passthrough=_EXISTS,
                Key=self._key(key),
                Body=body,
                ChecksumSHA256=sha256_b64([memoryview(body)]),
                **condition,
            )
        except ClientError:  # only the passthrough codes get here
            return False
        except ObjectNotFoundError:  # If-Match on an object deleted meanwhile
            return False
        return True
