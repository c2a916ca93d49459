"""Retries for S3 calls: transient failures are retried with jittered exponential backoff;
what still fails says how many attempts were made.

botocore's own "standard" retry mode spends a client-wide retry quota: under a burst of
5xx answers to hundreds of concurrent requests the quota runs dry and later calls fail
on their first error while the message still says "after retries". The S3 backend
therefore turns botocore's retries off and retries here, per call, a fixed number of
times. A transient failure (5xx, throttling, timeouts, resets, a body cut off while
streaming, bytes that failed their checksum on the way) that outlasts every attempt is
``StoreUnavailableError``: it proves nothing about the object, so restore stops instead
of falling back to an older checkpoint.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ckptflow.errors import ColdObjectError

T = TypeVar("T")
THROTTLING = {
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException", "SlowDown",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "BandwidthLimitExceeded",
    "BadDigest", "XAmzContentSHA256Mismatch",  # an upload S3 refused for its checksum: damaged on the way
}  # fmt: skip


def error_code(e: BaseException) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def http_status(e: BaseException) -> int:
    response = getattr(e, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_transient(e: BaseException) -> bool:
    """Whether trying again may succeed: the service or the network, not the request."""
    if isinstance(e, ClientError):
        return http_status(e) >= 500 or http_status(e) == 429 or error_code(e) in THROTTLING
    # FlexibleChecksumError: a body that fails the checksum S3 sent with it was damaged on the way
    transient = (BotoConnectionError, HTTPClientError, IncompleteReadError, FlexibleChecksumError)
    return isinstance(e, (*transient, ConnectionError, TimeoutError))


class AttemptsExhausted(Exception):
    """A transient failure that outlasted every attempt; ``attempts`` made, ``last`` error."""

    def __init__(self, attempts: int, last: BaseException):
        super().__init__(f"{attempts} attempts, the last {type(last).__name__}: {last}")
        self.attempts, self.last = attempts, last


@dataclass(frozen=True)
class Retry:
    """``max_attempts`` tries (the first included), sleeping a random time up to
    ``base * 2**n`` seconds (at most ``cap``) between them ("full jitter")."""

    max_attempts: int = 10
    base: float = 0.05
    cap: float = 5.0

    def call(self, attempt: Callable[[], T]) -> T:
        for n in range(1, self.max_attempts + 1):
            try:
                return attempt()
            except (BotoCoreError, ClientError, OSError) as e:
                if not is_transient(e):
                    raise
                if n == self.max_attempts:
                    raise AttemptsExhausted(n, e) from e
                time.sleep(random.uniform(0, min(self.cap, self.base * 2**n)))
        raise AssertionError("unreachable")


def botocore_config(pool: int) -> Any:
    """A client configuration with botocore's own retries off (``Retry`` does them) and a
    connection pool as large as the thread pools that share the client."""
    from botocore.config import Config

    return Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=pool,
    )


_STEP_KEY = re.compile(r"^runs/(?P<run>[^/]+)/checkpoints/(?P<step>\d+)/")  # names the step to thaw


def cold_object_error(url: str, where: str, key: str, e: ClientError) -> ColdObjectError:
    """``InvalidObjectState``: the object ``key`` of the store ``url`` (``where``) is in a cold
    class, which no retry reads: how to thaw it, naming its step where the key says."""
    storage_class = str(e.response.get("Error", {}).get("StorageClass", "") or "a cold storage class")
    step = _STEP_KEY.match(key)
    which = f"--run {step['run']} --step {int(step['step'])}" if step else "--run RUN --step STEP"
    return ColdObjectError(
        f"{where} is in {storage_class} and must be restored before it can be read: "
        f"run `ckptflow thaw {url} {which}` (or request an S3 restore of this object), "
        "wait for the restore to finish (minutes to hours), then retry"
    )
