"""The archive tier: a store URL, or S3 through dagster-aws (``resources/s3_archive.py``).

Assets and jobs take ``ArchiveTierResource``, so either implementation can be bound to
``archive``: a plain URL (a local directory by default, or any URL ``open_store`` takes)
or a bucket reached with dagster-aws's S3 settings and written in a storage class.
"""

import os

from dagster import ConfigurableResource
from pydantic import Field

from ckptflow.chunks.lossy import ArchiveCodec
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
        "or weights=exact|bf16,optimizer=exact|int8|drop (ckptflow.chunks.lossy)",
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
    ``S3ArchiveResource`` (``resources/s3_archive.py``)."""

    url: str = Field(default_factory=default_archive_url, description="archive store root URL")

    def open(self) -> Store:
        return open_store(self.url)
