"""Four gloo ranks (spawned processes, CPU) saving to one S3 server at once, then
restoring on four and on two ranks, and from the archive tier in a second bucket.

One 4-rank group runs ``save_and_restore`` (tests/support/dist_s3.py): steps 1-4 of a
DTensor-sharded model with its AdamW state, saved sync and async, full and incremental;
each restored on 4 ranks; step 4 archived by the lifecycle to the second bucket and
expired from the hot one, then restored from the archive. One 2-rank group then restores
every step (DCP reshards 4 -> 2), step 4 from the archive. Exact equality throughout:
every full tensor's sha256 and the optimizer's hyperparameters as saved.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch.distributed as dist

from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from support import dist_s3 as S
from support import dist_workers as W

pytestmark = [
    pytest.mark.slow,  # four gloo ranks against the S3 server, every save kind: make test-e2e
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]

STEPS = [str(step) for step, _, _ in S.SAVES]


@pytest.fixture(scope="module")
def stores(s3_endpoint) -> dict:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    names = {tier: f"{tier}-{uuid.uuid4().hex[:10]}" for tier in ("hot", "archive")}
    for name in names.values():
        client.create_bucket(Bucket=name)
    return {tier: f"s3://{name}/ckpts?endpoint={s3_endpoint}" for tier, name in names.items()}


def _launch(tmp_path_factory, stores: dict, scenario: str, world: int) -> W.Session:
    workdir = tmp_path_factory.mktemp(f"ranks{world}")
    (workdir / scenario).mkdir()
    (workdir / scenario / "config.json").write_text(json.dumps(stores))
    return W.launch([scenario], workdir, world=world, timeout=180, registry=S.__name__)


@pytest.fixture(scope="module")
def four(tmp_path_factory, stores) -> list[dict]:
    return _launch(tmp_path_factory, stores, "save_and_restore", 4).results("save_and_restore")


@pytest.fixture(scope="module")
def two(tmp_path_factory, stores, four) -> list[dict]:
    return _launch(tmp_path_factory, stores, "restore_resharded", 2).results("restore_resharded")


def test_four_ranks_commit_every_save_to_s3_with_their_own_shards(four, stores):
    assert [r["local_rows"] for r in four] == [3, 3, 3, 1]
    saved = four[0]["saved"]
    assert all(r["saved"] == saved for r in four)  # the full tensors every rank sees
    assert len({json.dumps(saved[s], sort_keys=True) for s in STEPS}) == len(STEPS)  # each step differs

    hot = open_store(stores["hot"])
    manifests = {step: catalog.read_manifest(hot, S.RUN, step) for step in (1, 2, 3)}
    for step, kind, _blocking in S.SAVES[:3]:
        m = manifests[step]
        assert (m.world_size, m.kind) == (4, kind)
        assert catalog.verify_checkpoint(hot, S.RUN, step).ok
        assert all(hot.exists(key) for key in m.rank_keys())
    # incremental: only what changed is written (the untrained buffer's chunks are reused)
    assert 0 < manifests[2].stats.chunks_written < manifests[2].stats.chunks
    assert manifests[3].stats.chunks_written == manifests[3].stats.chunks


def test_four_ranks_restore_every_step_exactly(four):
    for r in four:
        for step in STEPS:
            got = r["restored"][step]
            assert (got["step"], got["skipped"], got["progress"]) == (int(step), [], int(step))
            assert got["fingerprint"] == r["saved"][step], f"rank {r['rank']} step {step}"


def test_async_saves_snapshot_before_training_goes_on(four):
    # after each async save the ranks trained again at once; the checkpoint holds the state
    # as it was when save() returned, not the one training moved on to
    for r in four:
        for step, _kind, blocking in S.SAVES:
            if not blocking:
                assert r["restored"][str(step)]["fingerprint"] == r["saved"][str(step)]


def test_lifecycle_archives_to_the_second_bucket_and_restores_from_it(four, stores):
    archive = open_store(stores["archive"])
    assert catalog.verify_checkpoint(archive, S.RUN, S.ARCHIVED).ok
    assert catalog.read_manifest(archive, S.RUN, S.ARCHIVED).world_size == 4
    for r in four:
        assert r["hot_steps_after_expiry"] == [1, 2, 3]
        got = r["from_archive"]
        assert (got["step"], got["tier"]) == (S.ARCHIVED, archive.url)
        assert got["fingerprint"] == r["saved"][str(S.ARCHIVED)]


def test_two_ranks_restore_what_four_saved(four, two, stores):
    saved = four[0]["saved"]
    archive_url = open_store(stores["archive"]).url
    assert [r["local_rows"] for r in two] == [5, 5]
    for r in two:
        for step in STEPS:
            got = r["restored"][step]
            assert (got["step"], got["skipped"], got["progress"]) == (int(step), [], int(step))
            assert got["fingerprint"] == saved[step], f"2-rank restore of step {step} differs (rank {r['rank']})"
        assert r["restored"][str(S.ARCHIVED)]["tier"] == archive_url
        assert r["restored"]["1"]["tier"] != archive_url
