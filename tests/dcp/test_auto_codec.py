"""Codec "auto" on several ranks: the delta base is one answer for every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support import dist_workers, rank_failure_workers

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def test_a_listing_that_fails_on_rank_0_costs_the_deltas_not_the_save(tmp_path):
    # before: rank 0 raised alone and rank 1 waited in the broadcast of the base until the
    # group timed out, then failed with gloo's "Connection closed by peer"
    scenario = "delta_base_unlisted_on_rank_0"
    session = dist_workers.launch([scenario], tmp_path, timeout=60, registry=rank_failure_workers.__name__)
    for result in session.results(scenario):
        assert result["kinds"] == [[1, "full"], [2, "incremental"]]
        assert result["took_s"] < 10
