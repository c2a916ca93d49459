"""S3-specific behaviour against a real S3 API server (moto over HTTP): the create-only
commit against a second writer, multipart uploads and their abort, retries of 500s and
timeouts (botocore event hooks) and the clear error when they run out, cold storage
classes and ``ckptflow thaw``.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from botocore.exceptions import ReadTimeoutError

from ckptflow import Checkpointer, CheckpointExistsError, open_store
from ckptflow.cli import main
from ckptflow.errors import ColdObjectError, StoreError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.store.s3 import S3Store
from support.faulty_store import FaultyStore
from support.s3_faults import server_error, timeout
from support.states import CHUNK, RUN, blank_state, state_tag, tagged_state

MiB = 1 << 20


def fresh(endpoint: str, bucket: str, **kwargs) -> S3Store:
    """An S3Store with its own client, so event hooks stay local to one test."""
    return S3Store(bucket, "ckpts", endpoint_url=endpoint, **kwargs)


def no_uploads(client, bucket: str) -> bool:
    return not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


# ---- URLs and configuration ----------------------------------------------------------------
def test_open_store_s3_urls(s3_endpoint, s3_bucket, monkeypatch):
    store = open_store(f"s3://{s3_bucket}/a/b?endpoint={s3_endpoint}")
    assert isinstance(store, S3Store) and store.url == f"s3://{s3_bucket}/a/b"
    store.put_if_absent("k", b"v")
    monkeypatch.setenv("CKPTFLOW_S3_ENDPOINT_URL", s3_endpoint)
    via_env = open_store(f"s3://{s3_bucket}/a/b")
    assert via_env.get("k") == b"v"
    assert via_env.client.meta.config.retries == {"total_max_attempts": 1, "mode": "standard"}  # ours instead
    assert open_store(f"s3://{s3_bucket}").url == f"s3://{s3_bucket}"
    for bad in ("s3:///nobucket", f"s3://{s3_bucket}/p?endpoint=x&bogus=1"):
        with pytest.raises(ValueError, match="s3://bucket/prefix"):
            open_store(bad)


def test_a_missing_bucket_is_a_clear_error_never_a_missing_object(s3_endpoint):
    """S3 answers 404 NoSuchBucket for every call on a bucket that does not exist: taken
    for a missing object, a save failed with "...lease.json does not exist" on a PUT,
    ``exists`` said False and a read looked like a checkpoint with a chunk missing."""
    store = open_store(f"s3://no-such-bucket-{os.getpid()}/ckpts?endpoint={s3_endpoint}")
    calls = {
        "get": lambda: store.get("runs/r/manifest.json"),
        "exists": lambda: store.exists("chunks/ab/x"),  # a HEAD: its 404 has no body to say which
        "stat": lambda: store.stat("runs/r/manifest.json"),
        "put": lambda: store.put_if_absent("chunks/ab/x", b"v"),
        "list": lambda: list(store.list("runs/")),
        "delete_if": lambda: store.delete_if("locks/gc.json", '"etag"'),
    }
    for name, call in calls.items():
        with pytest.raises(StoreError) as err:
            call()
        assert not isinstance(err.value, KeyError), name
        assert "bucket no-such-bucket-" in str(err.value) and "does not exist" in str(err.value), name
        assert "create it" in str(err.value), name
    with Checkpointer(store, run=RUN) as ck, pytest.raises(StoreError, match="bucket no-such-bucket-"):
        ck.save(1, tagged_state(1))


# ---- the create-only commit ----------------------------------------------------------------
def test_conditional_commit_refuses_a_second_writer(s3_store_url):
    store = open_store(s3_store_url)
    assert store.put_if_absent("runs/x/manifest.json", b"writer A") is True
    assert store.put_if_absent("runs/x/manifest.json", b"writer B") is False
    assert store.get("runs/x/manifest.json") == b"writer A"

    # Two Checkpointers save the same step at once: B is held just before its commit
    # while A saves and commits; B's create-only put then fails.
    held = FaultyStore(store)
    pause = held.pause_before("put_if_absent", lambda key: key == fmt.manifest_key(RUN, 1))
    errors: list = []

    def save_b() -> None:
        with Checkpointer(held, run=RUN, chunk_bytes=CHUNK) as b:
            try:
                b.save(1, tagged_state(3))
            except CheckpointExistsError as e:
                errors.append(e)

    writer_b = threading.Thread(target=save_b)
    writer_b.start()
    try:
        assert pause.reached.wait(30)
        with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as a:
            a.save(1, tagged_state(2))
    finally:
        pause.release()
        writer_b.join(30)
    assert len(errors) == 1 and "another writer committed the step while this save ran" in str(errors[0])
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2
        assert ck.verify(1).ok
        with pytest.raises(CheckpointExistsError):  # a later writer is refused up front
            ck.save(1, tagged_state(4))


# ---- multipart -----------------------------------------------------------------------------
def test_multipart_round_trip_and_create_only(s3_endpoint, s3_bucket, s3_client):
    store = fresh(s3_endpoint, s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB)
    data = os.urandom(11 * MiB)
    assert store.put_if_absent("big", [data[:7], memoryview(data)[7:]]) is True
    assert store.get("big") == data and store.stat("big").size == len(data)
    assert store.put_if_absent("big", data[::-1]) is False  # CompleteMultipartUpload's If-None-Match
    assert store.get("big") == data
    store.replace("big", data[::-1])
    assert store.get("big") == data[::-1]
    assert no_uploads(s3_client, s3_bucket)


def test_checkpoint_with_multipart_chunks(s3_endpoint, s3_bucket):
    store = fresh(s3_endpoint, s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB)
    weights = torch.randn(3 * MiB // 2)  # one 6 MiB chunk: two parts
    with Checkpointer(store, run=RUN, chunk_bytes=6 * MiB) as ck:
        ck.save(1, {"w": weights})
        state = {"w": torch.zeros_like(weights)}
        assert ck.restore(state).step == 1 and torch.equal(state["w"], weights)


def test_failure_mid_multipart_leaves_nothing_behind(s3_endpoint, s3_bucket, s3_client):
    store = fresh(s3_endpoint, s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB, max_attempts=2)
    parts: list = []

    def fail_after_first_part(**kwargs) -> None:
        parts.append(kwargs["params"]["query_string"]["partNumber"])
        if len(parts) > 1:
            raise ConnectionResetError("injected: the network died mid-upload")

    store.client.meta.events.register("before-call.s3.UploadPart", fail_after_first_part)
    with pytest.raises(StoreUnavailableError, match="UploadPart .* failed after 2 attempts: ConnectionResetError"):
        store.put_if_absent("chunks/ab/big", os.urandom(11 * MiB))
    assert [int(n) for n in parts] == [1, 2, 2]  # part 2 retried once, then the upload aborted
    assert not store.exists("chunks/ab/big")
    assert s3_client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    assert no_uploads(s3_client, s3_bucket)


def test_an_object_never_needs_more_parts_than_s3_takes(s3_endpoint, s3_bucket, s3_client, monkeypatch):
    """S3 takes at most 10,000 parts: a model file over 10,000 part sizes (156 GiB at 16 MiB)
    was refused at part 10,001, after every part before it was sent. The part size now grows
    to fit (the limit is lowered here to show it on 11 MiB)."""
    from ckptflow.store import s3_multipart

    monkeypatch.setattr(s3_multipart, "MAX_PARTS", 2)
    store = fresh(s3_endpoint, s3_bucket, multipart_threshold=5 * MiB, part_size=5 * MiB)
    parts: list = []
    store.client.meta.events.register("before-call.s3.UploadPart", lambda **kw: parts.append(kw["params"]))
    data = os.urandom(11 * MiB)
    store.replace("model.bin", data)
    assert len(parts) == 2 and store.get("model.bin") == data
    assert no_uploads(s3_client, s3_bucket)


# ---- retries and the error when they run out ----------------------------------------------
@pytest.mark.parametrize("inject", [server_error, timeout], ids=["500", "timeout"])
def test_transient_failures_are_retried(s3_endpoint, s3_bucket, inject):
    store = fresh(s3_endpoint, s3_bucket, max_attempts=4)
    injected = []

    def flaky(request, **_kwargs):
        if request.method == "PUT" and len(injected) < 2:  # the first two PUTs of the save
            injected.append(request.url)
            return inject(request)
        return None

    store.client.meta.events.register("before-send.s3.*", flaky)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(2))
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2
    assert len(injected) == 2


def test_a_commit_whose_response_was_lost_is_not_a_second_writer(s3_endpoint, s3_bucket):
    """The manifest PUT reaches S3 but its response times out: the retry gets 412 on the
    object it created itself, which must count as committed, not as another writer's."""
    store = fresh(s3_endpoint, s3_bucket)
    lost = []

    def deliver_then_time_out(request, **_kwargs):
        if request.method == "PUT" and request.url.split("?")[0].endswith("manifest.json") and not lost:
            lost.append(store.client._endpoint.http_session.send(request).status_code)
            raise ReadTimeoutError(endpoint_url=request.url)
        return None

    store.client.meta.events.register("before-send.s3.*", deliver_then_time_out)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        assert ck.save(1, tagged_state(2)).info is not None
    assert lost == [200]
    assert store.put_if_absent(fmt.manifest_key(RUN, 1), b"another writer's manifest") is False
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2


@pytest.mark.parametrize("inject", [server_error, timeout], ids=["500", "timeout"])
def test_persistent_failure_is_a_clear_error_and_commits_nothing(s3_endpoint, s3_bucket, inject):
    store = fresh(s3_endpoint, s3_bucket, max_attempts=2)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    attempts = []

    def broken(request, **_kwargs):
        if request.method == "PUT" and "/chunks/" in request.url:
            attempts.append(request.url)
            return inject(request)
        return None

    store.client.meta.events.register("before-send.s3.*", broken)
    with Checkpointer(store, run=RUN, chunk_bytes=CHUNK) as ck, pytest.raises(StoreError) as err:
        ck.save(2, tagged_state(2))
    message = str(err.value)
    assert f"s3://{s3_bucket}/ckpts/chunks/" in message and "PutObject" in message
    assert ("InternalError" if inject is server_error else "ReadTimeoutError") in message
    assert len(attempts) >= 2  # retried before giving up
    assert not store.exists(fmt.manifest_key(RUN, 2))
    with Checkpointer(store, run=RUN, restore_rng=False) as ck:
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 1


def test_a_body_cut_off_mid_transfer_is_retried(s3_endpoint, s3_bucket):
    store = fresh(s3_endpoint, s3_bucket, max_attempts=3)
    store.put_if_absent("obj", b"payload")
    cuts = {"left": 2, "done": 0}

    class CutOff:
        def read(self):
            raise ReadTimeoutError(endpoint_url="injected mid-body")

    def cut(parsed, **_kwargs) -> None:
        if cuts["left"]:
            cuts["left"] -= 1
            cuts["done"] += 1
            parsed["Body"] = CutOff()

    store.client.meta.events.register("after-call.s3.GetObject", cut)
    assert store.get("obj") == b"payload" and cuts["done"] == 2
    cuts["left"] = 3
    with pytest.raises(StoreError, match=f"s3://{s3_bucket}/ckpts/obj .*after 3 attempts"):
        store.get("obj")


# ---- listings --------------------------------------------------------------------------------
def test_folder_markers_in_the_bucket_are_no_objects(s3_store_url, s3_bucket, s3_client, capsys):
    """Zero-byte keys ending in '/' (the S3 console's "Create folder", s3fs, rclone mkdir) are
    directory placeholders. Listed as objects, the one of ``chunks/`` stopped GC ("store key
    'chunks/' has an unsafe segment") and a step's made ``ls`` and GC call a sound checkpoint
    "a file where a step directory belongs"."""
    with Checkpointer(s3_store_url, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    store = open_store(s3_store_url)
    before = [i.key for i in store.list("")]
    step = fmt.step_prefix(RUN, 1)
    for marker in ("", "chunks/", "runs/", fmt.checkpoints_prefix(RUN), step, f"{step}ranks/"):
        s3_client.put_object(Bucket=s3_bucket, Key=f"ckpts/{marker}", Body=b"")
    assert [i.key for i in store.list("")] == before
    assert [i.key for i in store.list(fmt.checkpoints_prefix(RUN), recursive=False)] == [step]
    assert [i.key for i in store.list_after("runs/", roll_up="/ranks/")] == [f"{step}manifest.json", f"{step}ranks/"]
    assert main(["gc", s3_store_url, "--grace", "1h"]) == 0 and main(["ls", s3_store_url]) == 0
    assert "step directory" not in capsys.readouterr().err


# ---- cold storage classes and thaw ---------------------------------------------------------
def test_cold_object_error_names_the_object_and_the_fix(s3_endpoint, s3_bucket, s3_client):
    store = fresh(s3_endpoint, s3_bucket)
    s3_client.put_object(Bucket=s3_bucket, Key="ckpts/frozen", Body=b"x", StorageClass="DEEP_ARCHIVE")
    with pytest.raises(ColdObjectError) as err:
        store.get("frozen")
    message = str(err.value)
    assert f"s3://{s3_bucket}/ckpts/frozen" in message and "DEEP_ARCHIVE" in message
    assert "ckptflow thaw" in message and "restore" in message
    assert store.request_thaw("frozen", days=2) is True
    assert store.get("frozen") == b"x"  # moto completes restores at once
    store.put_if_absent("warm", b"y")
    assert store.request_thaw("warm") is False  # not cold: nothing to do


def test_cli_on_an_s3_store(s3_store_url, capsys):
    with Checkpointer(s3_store_url, run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
        ck.save(2, tagged_state(2))
    open_store(s3_store_url).delete(fmt.manifest_key(RUN, 1))  # expired: its own chunks are garbage
    assert main(["ls", s3_store_url, "--json"]) == 0
    assert [c["step"] for c in json.loads(capsys.readouterr().out)] == [2]
    assert main(["verify", s3_store_url, "--run", RUN]) == 0
    assert "OK run r: step 2 verified" in capsys.readouterr().out
    assert main(["gc", s3_store_url, "--grace", "0s", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out
    assert main(["ls", "s3://", "--run", RUN]) == 2  # a usage error, not a traceback
    assert "s3://bucket/prefix" in capsys.readouterr().err


def test_thaw_restores_a_glacier_checkpoint(s3_endpoint, s3_bucket, capsys):
    url = f"s3://{s3_bucket}/ckpts?endpoint={s3_endpoint}"
    glacier = fresh(s3_endpoint, s3_bucket, storage_class="GLACIER")
    with Checkpointer(glacier, run=RUN, chunk_bytes=CHUNK) as ck:
        info = ck.save(1, tagged_state(2)).info
    thaw_hint = f"ckptflow thaw s3://{s3_bucket}/ckpts --run {RUN} --step 1"
    with pytest.raises(ColdObjectError, match=thaw_hint):
        open_store(url).get(fmt.manifest_key(RUN, 1))
    with Checkpointer(url, run=RUN, restore_rng=False) as ck, pytest.raises(ColdObjectError, match=thaw_hint):
        ck.restore(blank_state())  # a cold checkpoint is no damage: no fallback, and the error says what to do

    assert main(["thaw", url, "--run", RUN]) == 0  # the manifest is cold: chunks unknown yet
    first = capsys.readouterr().out
    assert "restore requested for 2 cold object(s) of 2" in first and "run `ckptflow thaw` again" in first
    assert main(["thaw", url, "--run", RUN, "--step", "1", "--days", "3"]) == 0
    second = capsys.readouterr().out
    assert f"of {2 + info.chunks}" in second and "again" not in second
    with Checkpointer(url, run=RUN, restore_rng=False) as ck:
        assert ck.verify(1).ok
        state = blank_state()
        assert ck.restore(state).step == 1 and state_tag(state) == 2

    assert main(["thaw", url, "--run", RUN, "--step", "7"]) == 2
    assert "no committed step 7" in capsys.readouterr().err


def test_thaw_refuses_a_local_store(tmp_path, capsys):
    with Checkpointer(str(tmp_path / "s"), run=RUN, chunk_bytes=CHUNK) as ck:
        ck.save(1, tagged_state(1))
    assert main(["thaw", str(tmp_path / "s"), "--run", RUN]) == 2
    assert "thaw applies to s3:// stores" in capsys.readouterr().err
