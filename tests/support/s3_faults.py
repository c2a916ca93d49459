"""Fault injection for the S3 tests: botocore event hooks on one store's own client, so
a request fails before it leaves (as a load balancer's 5xx or a dropped connection
would) while everything else goes to the real S3 API server."""

from __future__ import annotations

import random
import threading

from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError, ReadTimeoutError


class _Raw:
    """The minimal raw HTTP body AWSResponse reads."""

    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_kwargs):
        yield self.body


def server_error(request, status: int = 500, code: str = "InternalError") -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected {status}</Message></Error>".encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


def timeout(request) -> None:
    raise ReadTimeoutError(endpoint_url=request.url)


def reset(request) -> None:
    raise ConnectionClosedError(endpoint_url=request.url)


class Bursts:
    """Fail a share ``rate`` of the requests a predicate picks with a 500, a 503 SlowDown,
    a timeout or a reset, at random (seeded); counts what it injected."""

    def __init__(self, client, rate: float, seed: int = 0, picks=lambda request: True):
        self.rate, self.picks = rate, picks
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.injected = 0
        self.requests = 0
        client.meta.events.register("before-send.s3.*", self)

    def __call__(self, request, **_kwargs):
        if not self.picks(request):
            return None
        with self.lock:
            self.requests += 1
            if self.random.random() >= self.rate:
                return None
            self.injected += 1
            kind = self.random.randrange(4)
        if kind == 0:
            return server_error(request)
        if kind == 1:
            return server_error(request, 503, "SlowDown")
        if kind == 2:
            return timeout(request)
        return reset(request)


class _ShortRaw:
    """A raw HTTP body that ends before its Content-Length: the connection dropped mid-body."""

    def __init__(self, body: bytes):
        self.body = body

    def read(self, amt: int | None = None) -> bytes:
        taken, self.body = (self.body, b"") if amt is None else (self.body[:amt], self.body[amt:])
        return taken

    def stream(self, **_kwargs):
        yield self.read()


class CutBodies:
    """Answer the next ``times`` GetObject requests of keys containing ``key_part`` with
    headers announcing ``length`` bytes and a body cut off after 10 (botocore raises
    IncompleteReadError while the caller reads it)."""

    def __init__(self, client, key_part: str, length: int, times: int = 1):
        self.key_part, self.length, self.left = key_part, length, times
        client.meta.events.register("before-send.s3.GetObject", self)

    def __call__(self, request, **_kwargs):
        if self.left <= 0 or self.key_part not in request.url:
            return None
        self.left -= 1
        headers = {"Content-Length": str(self.length), "ETag": '"cut"'}
        return AWSResponse(request.url, 200, headers, _ShortRaw(b"0123456789"))


class CutAfter:
    """A GET body that delivers ``after`` bytes of the real one, then times out."""

    def __init__(self, body, after: int, before_cut=lambda: None):
        self.body, self.left, self.before_cut = body, after, before_cut

    def read(self, amt=None):
        if self.left <= 0:
            self.before_cut()
            raise ReadTimeoutError(endpoint_url="injected mid-body")
        data = self.body.read(min(amt if amt is not None else self.left, self.left))
        self.left -= len(data)
        return data

    def close(self):
        self.body.close()


def cut_first_get(store, after: int, before_cut=lambda: None) -> None:
    """Cut the next GetObject body of ``store``'s client after ``after`` bytes (``before_cut``
    runs just before): the read that follows sees a connection time out mid-body."""
    left = [1]

    def cut(parsed, **_kwargs) -> None:
        if left[0]:
            left[0] -= 1
            parsed["Body"] = CutAfter(parsed["Body"], after, before_cut)

    store.client.meta.events.register("after-call.s3.GetObject", cut)
