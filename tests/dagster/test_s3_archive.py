"""The S3 archive resource: chosen from ``CKPTFLOW_ARCHIVE``, dagster-aws's ``S3Resource``
feeding ckptflow's S3 backend in the configured storage class."""

import pytest

from resources import S3ArchiveResource


def test_definitions_pick_the_s3_archive_from_the_environment(monkeypatch):
    from dagster_aws.s3 import S3Resource

    from pipelines.definitions import resources_for

    monkeypatch.setenv("CKPTFLOW_ARCHIVE", "s3://arch-bucket/team/ckpts")
    monkeypatch.setenv("CKPTFLOW_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CKPTFLOW_ARCHIVE_STORAGE_CLASS", "DEEP_ARCHIVE")
    for deployment in ("local", "production"):
        archive = resources_for(deployment)["archive"]
        assert isinstance(archive, S3ArchiveResource) and isinstance(archive.s3, S3Resource)
        assert (archive.bucket, archive.prefix, archive.storage_class) == ("arch-bucket", "team/ckpts", "DEEP_ARCHIVE")
        assert archive.s3.endpoint_url == "http://127.0.0.1:9"


def test_s3_archive_opens_an_s3_store_through_the_dagster_aws_client(s3_endpoint, s3_bucket):
    resource = S3ArchiveResource(endpoint_url=s3_endpoint, bucket=s3_bucket, prefix="a/b", storage_class="GLACIER_IR")
    store = resource.open()
    assert store.url == f"s3://{s3_bucket}/a/b" and store.storage_class == "GLACIER_IR"
    assert store.put_if_absent("x/y", b"z") and store.get("x/y") == b"z"
    head = store.client.head_object(Bucket=s3_bucket, Key="a/b/x/y")
    assert head["StorageClass"] == "GLACIER_IR"
    with pytest.raises(ValueError, match="storage_class"):
        S3ArchiveResource(bucket=s3_bucket, storage_class="COLDEST").open()
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        S3ArchiveResource.from_url("file:///tmp/x")
