"""``S3Store.get_into`` and ``S3Store.scan`` stream the GET body (``ckptflow.store.s3_read``)
and keep ``Store``'s contract: buffers filled only when the object is their total size,
pieces handed over in order and never across two buffers, (size, ETag) returned, an object
over ``scan``'s limit refused from its length header. A body cut off is retried from the
end of its last whole piece (a ranged GET of the same ETag), ``consume`` seeing each byte
once; an object replaced between attempts,
a cold object and a consumer's own error each end the read as what they are."""

from __future__ import annotations

import errno

import pytest

from ckptflow.errors import ColdObjectError, ObjectTooLargeError, StoreError, StoreUnavailableError
from ckptflow.store.s3 import S3Store
from ckptflow.store.s3_retry import Retry
from support.s3_faults import CutAfter, cut_first_get, server_error

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes


def fresh(endpoint: str, bucket: str) -> S3Store:
    """A store with its own client (event hooks stay in the test) and quick retries."""
    return S3Store(bucket, "ckpts", endpoint_url=endpoint, retry=Retry(max_attempts=3, base=0.001, cap=0.01))


def count_gets(store: S3Store) -> list[str]:
    gets: list[str] = []
    store.client.meta.events.register("before-send.s3.GetObject", lambda request, **_: gets.append(request.url))
    return gets


def ranges_asked(store: S3Store) -> list[tuple[str | None, str | None]]:
    """Each GetObject's (Range, If-Match) headers, in order."""
    asked: list[tuple[str | None, str | None]] = []

    def note(request, **_kwargs):
        headers = (request.headers.get("Range"), request.headers.get("If-Match"))
        asked.append(tuple(h.decode() if isinstance(h, bytes) else h for h in headers))

    store.client.meta.events.register("before-send.s3.GetObject", note)
    return asked


def test_get_into_fills_the_buffers_piece_by_piece_and_names_the_etag(s3_endpoint, s3_bucket):
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    head, body = bytearray(100), bytearray(len(DATA) - 100)
    pieces: list[bytes] = []
    size, version = store.get_into("obj", [head, body], consume=lambda p: pieces.append(bytes(p)), piece=4096)
    assert (size, version) == (len(DATA), store.stat("obj").version) and version
    assert bytes(head + body) == DATA
    assert [len(p) for p in pieces] == [100, 4096, 4096, len(DATA) - 100 - 8192]  # none spans the two buffers
    assert b"".join(pieces) == DATA


def test_get_into_leaves_buffers_of_another_size_alone(s3_endpoint, s3_bucket):
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    store.put_if_absent("empty", b"")
    short = bytearray(b"\xee" * (len(DATA) - 1))
    assert store.get_into("obj", [short], consume=lambda p: pytest.fail("handed a piece"))[0] == len(DATA)
    assert short == b"\xee" * (len(DATA) - 1)
    assert store.get_into("empty", [], consume=lambda p: pytest.fail("handed a piece")) == (
        0,
        store.stat("empty").version,
    )


def test_scan_streams_through_its_buffer_and_refuses_an_object_over_its_limit(s3_endpoint, s3_bucket):
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    pieces: list[bytes] = []
    size, version = store.scan("obj", memoryview(bytearray(1000)), lambda p: pieces.append(bytes(p)), limit=len(DATA))
    assert (size, version) == (len(DATA), store.stat("obj").version)
    assert b"".join(pieces) == DATA and max(map(len, pieces)) == 1000 and len(pieces) == 11
    with pytest.raises(ObjectTooLargeError, match=f"s3://{s3_bucket}/ckpts/obj holds {len(DATA)} bytes"):
        store.scan("obj", memoryview(bytearray(1000)), lambda p: pytest.fail("read past the limit"), limit=10)


@pytest.mark.parametrize("fault", ["500", "cut mid-body"])
def test_a_failed_get_is_retried_and_consume_sees_each_byte_once(s3_endpoint, s3_bucket, fault):
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    if fault == "500":
        left = [1]

        def fail_once(request, **_kwargs):
            if left[0]:
                left[0] -= 1
                return server_error(request)
            return None

        store.client.meta.events.register("before-send.s3.GetObject", fail_once)
    else:
        cut_first_get(store, after=5000)  # pieces 0 to 3 whole, the fifth cut
    gets = count_gets(store)
    out, pieces = bytearray(len(DATA)), []
    assert store.get_into("obj", [out], consume=lambda p: pieces.append(bytes(p)), piece=1024)[0] == len(DATA)
    assert bytes(out) == DATA and b"".join(pieces) == DATA and len(gets) == 2
    assert [len(p) for p in pieces] == [1024] * 10 + [len(DATA) - 10240]  # each piece handed over once
    pieces.clear()
    cut_first_get(store, after=3000)
    assert store.scan("obj", memoryview(bytearray(1024)), lambda p: pieces.append(bytes(p)))[0] == len(DATA)
    assert b"".join(pieces) == DATA


def test_a_body_cut_off_resumes_after_its_last_whole_piece_of_the_same_object(s3_endpoint, s3_bucket):
    """Before: the retry fetched the object from its first byte again (a model file cut off
    near its end was downloaded twice). Now it asks for the rest only, of the ETag read."""
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    etag = store.stat("obj").version
    cut_first_get(store, after=5000)
    asked, pieces = ranges_asked(store), []
    assert store.scan("obj", memoryview(bytearray(1024)), lambda p: pieces.append(bytes(p))) == (len(DATA), etag)
    assert b"".join(pieces) == DATA
    assert asked == [(None, None), ("bytes=4096-", etag)]


def test_an_object_replaced_between_attempts_is_not_mixed(s3_endpoint, s3_bucket, s3_client):
    """The first GET is cut off after 5000 bytes went to ``consume``; the object is replaced
    before the retry: its bytes would follow the old ones, so the read fails instead."""
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    cut_first_get(store, 5000, lambda: s3_client.put_object(Bucket=s3_bucket, Key="ckpts/obj", Body=DATA[::-1]))
    pieces: list[bytes] = []
    with pytest.raises(StoreError, match=f"s3://{s3_bucket}/ckpts/obj was replaced while it was read .*read it again"):
        store.scan("obj", memoryview(bytearray(1024)), lambda p: pieces.append(bytes(p)))
    assert b"".join(pieces) == DATA[:4096]


def test_a_consumer_error_passes_through_unretried_and_a_cold_object_says_how_to_thaw(
    s3_endpoint, s3_bucket, s3_client
):
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(_piece):
        raise full

    gets = count_gets(store)
    with pytest.raises(OSError) as err:
        store.scan("obj", memoryview(bytearray(1024)), no_space)
    assert err.value is full and len(gets) == 1  # not a network failure: neither retried nor renamed
    s3_client.put_object(Bucket=s3_bucket, Key="ckpts/frozen", Body=b"x", StorageClass="DEEP_ARCHIVE")
    for read in (
        lambda: store.scan("frozen", memoryview(bytearray(8)), lambda p: None),
        lambda: store.get_into("frozen", [bytearray(1)]),
    ):
        with pytest.raises(ColdObjectError, match="ckptflow thaw"):
            read()


def cut_every_get(store: S3Store, after: int) -> None:
    """Every GetObject body of ``store``'s client is cut after ``after`` bytes."""
    store.client.meta.events.register(
        "after-call.s3.GetObject", lambda parsed, **_: parsed.update(Body=CutAfter(parsed["Body"], after))
    )


def test_a_read_cut_off_again_and_again_finishes_while_each_round_of_retries_moves_it_on(s3_endpoint, s3_bucket):
    """Every GET delivers two whole pieces, then the connection drops: the store's three
    attempts ran out at 6 KiB of 10 KiB, and the read failed as an outage although each
    attempt had moved it on. A read that moves nothing still fails after its attempts."""
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    cut_every_get(store, after=3000)
    gets, pieces = count_gets(store), []
    assert store.scan("obj", memoryview(bytearray(1024)), lambda p: pieces.append(bytes(p)))[0] == len(DATA)
    assert b"".join(pieces) == DATA and len(gets) == 5  # 2 whole pieces a GET: 3 attempts, then 2 more
    stuck = fresh(s3_endpoint, s3_bucket)
    cut_every_get(stuck, after=500)  # less than a piece: no GET moves it on
    gets = count_gets(stuck)
    with pytest.raises(StoreUnavailableError, match="failed after 3 attempts"):
        stuck.scan("obj", memoryview(bytearray(1024)), lambda p: None)
    assert len(gets) == 3


def test_a_resume_from_a_store_that_ignores_range_skips_what_was_read(s3_endpoint, s3_bucket):
    """An S3-compatible store (or a proxy) may answer a ranged GET with the whole object (200, no
    Content-Range): the resume failed with "S3 answered ''". The bytes already read are now
    skipped in that body, so ``consume`` still sees each byte once."""
    store = fresh(s3_endpoint, s3_bucket)
    store.put_if_absent("obj", DATA)
    cut_first_get(store, after=5000)

    def drop_range(request, **_kwargs):
        request.headers.pop("Range", None)

    store.client.meta.events.register("before-send.s3.GetObject", drop_range)
    pieces: list[bytes] = []
    assert store.scan("obj", memoryview(bytearray(1024)), lambda p: pieces.append(bytes(p)))[0] == len(DATA)
    assert b"".join(pieces) == DATA
