"""The archive tier: a store URL, or S3 through dagster-aws's ``S3Resource``.

Assets and jobs take ``ArchiveTierResource``, so either implementation can be bound to
``archive``: a plain URL (a local directory by default, or any URL ``open_store`` takes)
or a bucket reached with dagster-aws credentials and written in a storage class.
"""

import os
from urllib.parse import urlparse

from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field

from ckptflow.lossy import ArchiveCodec
from ckptflow.store import Store, open_store
from resources.store import REPO


def default_archive_url() -> str:
    """``CKPTFLOW_ARCHIVE``, else a directory next to the demo store."""
    return os.environ.get("CKPTFLOW_ARCHIVE") or os.path.join(REPO, ".demo", "archive")


def default_archive_codec() -> str:
    """``CKPTFLOW_ARCHIVE_CODEC``, else exact copies."""
    return os.environ.get("CKPTFLOW_ARCHIVE_CODEC") or "exact"


class ArchiveTierResource(ConfigurableResource):
    """What the lifecycle needs of an archive tier: ``open()`` gives its store, and
    ``archive_codec`` how archival writes into it. Assets and jobs take this type, so
    either implementation below can be bound to ``archive``."""

    archive_codec: str = Field(
        default_factory=default_archive_codec,
        description="exact, or a lossy archive codec: bf16, bf16+int8, int8, model-only, model-only-bf16, "
        "or weights=exact|bf16,optimizer=exact|int8|drop (ckptflow.lossy)",
    )

    def open(self) -> Store:
        raise NotImplementedError

    def codec(self) -> ArchiveCodec:
        return ArchiveCodec.parse(self.archive_codec)

    def priced_class(self) -> str | None:
        """The S3 storage class the archive writes (what the cost model prices it as), if known."""
        return None


class ArchiveResource(ArchiveTierResource):
    """The archive tier as a store URL: a local directory (the default) or any URL
    ``open_store`` takes, ``s3://bucket/prefix`` included (credentials from the AWS
    environment). For S3 with dagster-aws credentials and a storage class, use
    ``S3ArchiveResource``."""

    url: str = Field(default_factory=default_archive_url, description="archive store root URL")

    def open(self) -> Store:
        return open_store(self.url)


S3_STORAGE_CLASSES = (
    "STANDARD",
    "STANDARD_IA",
    "ONEZONE_IA",
    "INTELLIGENT_TIERING",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
)


class S3ArchiveResource(ArchiveTierResource):
    """The archive tier on S3: a bucket and prefix, reached through dagster-aws's
    ``S3Resource`` (its region, endpoint URL, profile or keys), written in a storage
    class. ``GLACIER_IR`` reads back at once, so archival re-reads every object to
    verify it; ``GLACIER`` / ``DEEP_ARCHIVE`` objects must be thawed before a restore
    (``ColdObjectError`` says so)."""

    s3: S3Resource = Field(description="dagster-aws S3 resource: credentials, region, endpoint URL")
    bucket: str = Field(description="bucket holding the archive")
    prefix: str = Field(default="", description="key prefix inside the bucket (the archive's root)")
    storage_class: str | None = Field(default=None, description="S3 storage class of archived objects, e.g. GLACIER_IR")

    def priced_class(self) -> str | None:
        return self.storage_class

    def open(self) -> Store:
        from ckptflow.store.s3 import S3Store  # boto3 only where an S3 archive is configured

        if self.storage_class is not None and self.storage_class not in S3_STORAGE_CLASSES:
            raise ValueError(f"storage_class {self.storage_class!r} is not one of {S3_STORAGE_CLASSES}")
        return S3Store(self.bucket, self.prefix, client=self.s3.get_client(), storage_class=self.storage_class)

    @classmethod
    def from_url(
        cls, url: str, *, endpoint_url: str | None = None, region: str | None = None, storage_class: str | None = None
    ) -> "S3ArchiveResource":
        """From ``s3://bucket/prefix``; endpoint and region go to the ``S3Resource``."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc or parsed.query:
            raise ValueError(f"archive URL {url!r} must look like s3://bucket/prefix")
        return cls(
            s3=S3Resource(endpoint_url=endpoint_url, region_name=region),
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            storage_class=storage_class,
        )
