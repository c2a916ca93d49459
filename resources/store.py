"""Store-backed resources: the hot checkpoint store and the model registry.

Each is configured by one URL, so the same code runs against a local directory in a
test, the demo store under the repo, or ``s3://bucket/prefix``; the library picks the
backend from the URL scheme. Defaults come from environment variables so `dagster dev`
works with no configuration at all.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

from dagster import AssetExecutionContext, ConfigurableResource, Failure, RetryRequested
from pydantic import Field

from ckptflow.errors import ColdObjectError, StoreUnavailableError
from ckptflow.interop.registry import Registry
from ckptflow.store import Store, open_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_store_url() -> str:
    """``CKPTFLOW_STORE``, else the demo store under the repo (what `make demo` writes)."""
    return os.environ.get("CKPTFLOW_STORE") or os.path.join(REPO, ".demo", "store")


class CheckpointStoreResource(ConfigurableResource):
    """The hot store training writes to (a path, a ``file://`` or an ``s3://`` URL)."""

    url: str = Field(default_factory=default_store_url, description="store root URL")
    unavailable_retries: int = Field(
        default=4, description="times a run retries a store that could not be read (after its own retries)"
    )
    unavailable_wait_s: float = Field(
        default=60.0, description="seconds before the first such retry; doubled for each next one"
    )

    def open(self) -> Store:
        return open_store(self.url)

    def retry_unavailable(self, attempt: int) -> RetryRequested:
        """What a run raises when the store could not be read (an outage proves nothing
        about a checkpoint): retry the step later, with exponential backoff. Raise it
        ``from`` a ``Failure`` that says what could not be read: the step fails with that
        once the retries are spent."""
        return RetryRequested(self.unavailable_retries, self.unavailable_wait_s * 2**attempt)

    @contextmanager
    def retrying_outages(self, context: AssetExecutionContext) -> Iterator[None]:
        """Around an asset's store work: a ``StoreUnavailableError`` (an outage, a denied
        object) retries the step later (``retry_unavailable``) instead of failing its
        partition. A ``ColdObjectError`` fails the step at once, saying how to thaw: a thaw
        takes hours, so retries minutes apart would read the same cold object and only delay
        the instruction. Proof of damage and every other error pass through unchanged."""
        try:
            yield
        except ColdObjectError as e:
            raise Failure(description=str(e), allow_retries=False) from e
        except StoreUnavailableError as e:
            context.log.warning(f"{e} (attempt {context.retry_number + 1} of {self.unavailable_retries + 1})")
            raise self.retry_unavailable(context.retry_number) from Failure(description=str(e))


class RegistryResource(ConfigurableResource):
    """The model registry, kept under ``registry/`` in a store (the hot store by default)
    so a model version and the checkpoint it came from live side by side."""

    url: str = Field(default_factory=default_store_url, description="store root URL holding registry/")

    def open(self) -> Registry:
        return Registry(open_store(self.url))
