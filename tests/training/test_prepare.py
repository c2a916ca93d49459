"""``Checkpointer.prepare`` on several ranks while an async save is in flight."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support import dist_workers, rank_failure_workers

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def test_prepare_waits_for_the_async_save_before_its_own_collective(tmp_path):
    # before: prepare gathered on the save group while the async save's collectives ran on it
    # in the background; they paired up differently on the two ranks: rank 0 raised
    # "UnpicklingError: pickle data was truncated" and rank 1 hung until the group timed out
    scenario = "prepare_during_async_save"
    session = dist_workers.launch([scenario], tmp_path, timeout=60, registry=rank_failure_workers.__name__)
    assert [r["steps"] for r in session.results(scenario)] == [[1], [1]]
