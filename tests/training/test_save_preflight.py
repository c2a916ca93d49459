"""Before a save writes: any rank's refusal is every rank's, promptly, whatever it raised."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support import dist_workers, rank_failure_workers

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def test_a_state_dict_that_raises_on_one_rank_refuses_the_save_on_every_rank_at_once(tmp_path):
    # before: rank 1 raised alone and rank 0 waited in the save's first collective for the
    # group's timeout, then failed with gloo's "Connection closed by peer"
    scenario = "state_dict_raises_on_one_rank"
    session = dist_workers.launch([scenario], tmp_path, timeout=60, registry=rank_failure_workers.__name__)
    other, failing = session.results(scenario)
    assert failing["error"] == "RuntimeError: no state on rank 1"  # its own error, as raised
    assert other["error"].startswith("CkptflowError: rank 1 could not take the state to save (RuntimeError: no state")
    assert "no rank saved anything" in other["error"]
    assert other["refused_s"] < 10 and failing["refused_s"] < 10
    assert other["steps"] == failing["steps"] == [1]  # the collectives stayed in step: the next save commits
