"""An adaptive policy decides alike on every rank, though each rank measures other times."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ckptflow import open_store
from ckptflow.catalog import checkpoints as catalog
from support import dist_workers, rank_failure_workers

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def test_a_slower_rank_saves_at_the_same_steps_as_the_others(tmp_path):
    # before: each rank set its interval from its own step time, rank 0 skipped a step rank 1
    # saved, and rank 1 waited in the save's first collective until the group timed out
    session = dist_workers.launch(["adaptive_slow_rank"], tmp_path, timeout=60, registry=rank_failure_workers.__name__)
    fast, slow = session.results("adaptive_slow_rank")
    assert fast["saved"] == slow["saved"]
    committed = [m.step for m in catalog.committed(open_store(str(tmp_path / "adaptive_slow_rank" / "store")), "ranks")]
    assert committed == fast["saved"]
    assert len(committed) > 2  # the interval was set from measurements, not only the initial one
