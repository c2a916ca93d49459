"""A transient store error is not corruption (issue: faults found by trying to break it).

Reads that fail for a transient reason are retried; when the retries run out, restore
raises ``StoreUnavailableError`` naming the object and never falls back past a
checkpoint it could not read. Only proof of damage moves a restore to an older step.
"""

from __future__ import annotations

import base64
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.awsrequest import AWSResponse

from ckptflow import Checkpointer, NoValidCheckpointError, StoreUnavailableError, open_store
from ckptflow.store.s3 import S3Store
from ckptflow.store.s3_retry import Retry
from support.corrupt import chunk_path, flip_byte, only_in
from support.faulty_store import FaultyStore
from support.s3_faults import Bursts, CutBodies, _ShortRaw, server_error
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state

FAST = Retry(max_attempts=12, base=0.002, cap=0.05)  # the real backoff, on a test's time scale


def s3(endpoint: str, bucket: str, **kwargs) -> S3Store:
    return S3Store(bucket, "ckpts", endpoint_url=endpoint, **kwargs)


def two_checkpoints(store) -> None:
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(2))
        ck.save(2, tagged_state(3))


def test_bursts_of_5xx_timeouts_and_resets_never_change_what_restore_returns(s3_endpoint, s3_bucket):
    store = s3(s3_endpoint, s3_bucket, retry=FAST)
    two_checkpoints(store)
    bursts = Bursts(store.client, rate=0.3, seed=7, picks=lambda r: r.method in ("GET", "HEAD"))
    with Checkpointer(store, run=RUN, restore_rng=False, threads=8) as ck:
        for _ in range(5):
            state = blank_state()
            assert ck.restore(state).step == 2 and state_tag(state) == 3
    assert bursts.injected > 20  # the store really misbehaved


def test_an_outage_that_outlasts_the_retries_stops_restore_and_names_the_object(s3_endpoint, s3_bucket):
    store = s3(s3_endpoint, s3_bucket, retry=Retry(max_attempts=3, base=0.001, cap=0.01))
    two_checkpoints(store)
    newest_only = only_in_s3(store, 2, 1)
    Bursts(store.client, rate=1.0, picks=lambda r: r.method == "GET" and any(d in r.url for d in newest_only))
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        with pytest.raises(StoreUnavailableError) as err:
            ck.restore(state)
    message = str(err.value)
    assert "after 3 attempts" in message and f"s3://{s3_bucket}/ckpts/chunks/" in message
    assert "step 2" in message and "restore stopped rather than fall back" in message
    assert not isinstance(err.value, NoValidCheckpointError)  # a job that "starts fresh" on that must not
    assert state["epoch"] is None and state["z"].eq(-7).all()  # untouched


@pytest.mark.parametrize("read", ["get", "read_head", "get_versioned"])
def test_a_body_cut_off_while_streaming_is_retried_by_every_read(s3_endpoint, s3_bucket, read):
    """The connection drops after the headers: every read retries it like a failed request.
    ``read_head`` (an incremental save looking at a chunk it reuses) raised botocore's own
    IncompleteReadError, and ``get_versioned`` (a commit, an expiry, a lock) a StoreError."""
    store = s3(s3_endpoint, s3_bucket, retry=FAST)
    store.put_if_absent("chunks/ab/cd", bytes(range(100)))
    CutBodies(store.client, "chunks/ab/cd", length=100)
    got = {
        "get": lambda: store.get("chunks/ab/cd"),
        "read_head": lambda: store.read_head("chunks/ab/cd", 40),
        "get_versioned": lambda: store.get_versioned("chunks/ab/cd")[0],
    }[read]()
    assert got == bytes(range(100))[: 40 if read == "read_head" else 100]


def only_in_s3(store, step: int, other: int) -> list[str]:
    from ckptflow.catalog import checkpoints as catalog

    return sorted(
        set(catalog.read_manifest(store, RUN, step).chunks) - set(catalog.read_manifest(store, RUN, other).chunks)
    )


def test_400_concurrent_requests_at_30_percent_errors_all_succeed(s3_endpoint, s3_bucket):
    """botocore's standard mode spends a shared retry quota that such a burst exhausts;
    ckptflow's own per-call retries do not run dry, and "after N attempts" is true."""
    store = s3(s3_endpoint, s3_bucket, retry=FAST)
    for i in range(40):
        store.put_if_absent(f"objects/{i}", str(i).encode())
    bursts = Bursts(store.client, rate=0.3, seed=3, picks=lambda r: r.method == "GET")
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda i: store.get(f"objects/{i % 40}"), range(400)))
    assert got == [str(i % 40).encode() for i in range(400)]
    assert bursts.injected > 100


def test_a_local_read_error_is_not_damage(tmp_path):
    root = str(tmp_path / "store")
    two_checkpoints(root)
    store = FaultyStore(open_store(root))
    newest = set(only_in(root, RUN, 2, 1))
    store.fail_if = lambda op, key: op == "get" and key.rsplit("/", 1)[-1] in newest
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        with pytest.raises(StoreUnavailableError, match="injected fault"):
            ck.restore(state)
        assert state["epoch"] is None
        flip_byte(chunk_path(root, sorted(newest)[0]))  # proof of damage: now it falls back
        store.fail_if = lambda op, key: False
        result = ck.restore(state)
    assert result.step == 1 and state_tag(state) == 2 and "does not match its address" in result.skipped[0][1]


def test_a_listing_that_fails_through_every_retry_is_no_empty_store(s3_endpoint, s3_bucket):
    """Not knowing what exists must not read as "no checkpoints": a job would start fresh."""
    store = s3(s3_endpoint, s3_bucket, retry=Retry(max_attempts=3, base=0.001, cap=0.01))
    two_checkpoints(store)
    Bursts(store.client, rate=1.0, picks=lambda r: r.method == "GET" and "list-type=2" in r.url)
    with Checkpointer(store, run=RUN, restore_rng=False) as ck, pytest.raises(StoreUnavailableError) as err:
        ck.restore(blank_state())
    assert "could not list the checkpoints" in str(err.value) and "after 3 attempts" in str(err.value)


def test_bytes_damaged_on_the_way_are_sent_again_not_refused(s3_endpoint, s3_bucket):
    """A GET body that fails the checksum S3 sent with it (botocore's FlexibleChecksumError),
    or a PUT that S3 refuses for its checksum (400 BadDigest), was damaged on the wire, not
    in the store: both were a StoreError at once, which stopped the restore or the save."""
    store = s3(s3_endpoint, s3_bucket, retry=FAST)
    two_checkpoints(store)
    damaged = {"GET": 3, "PUT": 2}

    def on_the_wire(request, **_kwargs):
        if "/chunks/" not in request.url or not damaged.get(request.method):
            return None
        damaged[request.method] -= 1
        if request.method == "PUT":
            return server_error(request, 400, "BadDigest")
        real = store.client._endpoint.http_session.send(request)
        body = bytearray(real.content)
        body[len(body) // 2] ^= 1
        crc = base64.b64encode(zlib.crc32(real.content).to_bytes(4, "big")).decode()
        return AWSResponse(request.url, 200, {**real.headers, "x-amz-checksum-crc32": crc}, _ShortRaw(bytes(body)))

    store.client.meta.events.register("before-send.s3.*", on_the_wire)
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        result = ck.restore(state)
        assert result.step == 2 and state_tag(state) == 3 and not result.skipped
        ck.save(3, tagged_state(4), kind="full")
    assert damaged == {"GET": 0, "PUT": 0}
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        assert ck.restore(state).step == 3 and state_tag(state) == 4
