"""The archive tier on S3 through dagster-aws.

Its own module, imported only where an S3 archive is configured: importing dagster-aws
costs about 0.6 s, and every run process loads the code location.
"""

from urllib.parse import urlparse

from dagster_aws.s3 import S3Resource
from dagster_aws.s3.resources import ResourceWithS3Configuration
from pydantic import Field

from ckptflow.store import Store
from resources.archive import ArchiveTierResource

S3_STORAGE_CLASSES = (
    "STANDARD",
    "STANDARD_IA",
    "ONEZONE_IA",
    "INTELLIGENT_TIERING",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
)


class S3ArchiveResource(ResourceWithS3Configuration, ArchiveTierResource):
    """The archive tier on S3: a bucket and prefix, reached with dagster-aws's S3
    configuration (its region, endpoint URL, profile or keys: the fields of
    ``S3Resource``), written in a storage class. ``GLACIER_IR`` reads back at once, so
    archival re-reads every object to verify it; ``GLACIER`` / ``DEEP_ARCHIVE`` objects
    must be thawed before a restore (``ColdObjectError`` says so).

    The S3 settings are this resource's own fields rather than a nested ``S3Resource``:
    Dagster initializes a nested resource through ``InitResourceContext.dagster_run``,
    which it deprecates, and would warn in every run."""

    bucket: str = Field(description="bucket holding the archive")
    prefix: str = Field(default="", description="key prefix inside the bucket (the archive's root)")
    storage_class: str | None = Field(default=None, description="S3 storage class of archived objects, e.g. GLACIER_IR")

    @property
    def s3(self) -> S3Resource:
        """dagster-aws's ``S3Resource`` with this archive's S3 settings (it builds the client)."""
        return S3Resource(**{name: getattr(self, name) for name in ResourceWithS3Configuration.model_fields})

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
        """From ``s3://bucket/prefix``; endpoint and region are the S3 settings."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc or parsed.query:
            raise ValueError(f"archive URL {url!r} must look like s3://bucket/prefix")
        return cls(
            endpoint_url=endpoint_url,
            region_name=region,
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            storage_class=storage_class,
        )
