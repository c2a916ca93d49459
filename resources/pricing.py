"""Storage prices: one resource, so every asset that says what storage costs says the same.

``storage_cost``, ``checkpoint_inventory`` and ``recoverability`` all price tiers with
``PricingResource.model`` (they used to take prices as run config on one asset and the
defaults on the others, so one configured price list showed two $/month figures). A
deployment sets its prices once, in ``pipelines/definitions.py``: by default S3 list
prices (``ckptflow.reports.costs.DEFAULT_PRICES``), or the JSON file named by
``CKPTFLOW_PRICES`` in the format ``ckptflow stats --prices FILE`` reads, read when the code
location loads (a bad file stops it loading, with the reason; a changed one needs a reload).
"""

from __future__ import annotations

import os

from dagster import ConfigurableResource
from pydantic import Field

from ckptflow.reports import costs
from resources.archive import ArchiveTierResource

PRICES_ENV = "CKPTFLOW_PRICES"


class PricingResource(ConfigurableResource):
    """USD per GB-month per storage class (overriding or extending the defaults), and the
    classes the tiers are priced as; an S3 archive is priced as the storage class it
    writes when that class has a price."""

    prices: dict[str, float] = Field(default_factory=dict, description="USD per GB-month per storage class")
    hot_class: str = Field(default=costs.DEFAULT_TIERS["hot"], description="storage class the hot tier is priced as")
    archive_class: str = Field(
        default=costs.DEFAULT_TIERS["archive"],
        description="storage class the archive is priced as when it does not say its own",
    )

    @classmethod
    def from_env(cls) -> PricingResource:
        """The price file ``CKPTFLOW_PRICES`` names, if set; else the defaults."""
        path = os.environ.get(PRICES_ENV)
        if not path:
            return cls()
        model = costs.read_cost_model(path, given_as=f"{PRICES_ENV}={path}")  # bounded: a pipe, never /dev/zero
        return cls(prices=dict(model.prices), hot_class=model.tiers["hot"], archive_class=model.tiers["archive"])

    def model(self, archive: ArchiveTierResource) -> costs.CostModel:
        prices = {**costs.DEFAULT_PRICES, **self.prices}
        priced = archive.priced_class()
        return costs.CostModel(prices).with_classes(
            hot=self.hot_class, archive=priced if priced in prices else self.archive_class
        )
