"""Helpers shared by test_checkpointer.py (save side) and test_restore.py (restore side):
snapshot a tiny training state, compare a live state to a snapshot, locate a manifest.

The ``make_ck`` fixture both files use lives in conftest.py.
"""

from __future__ import annotations

import copy
import os

import torch

from ckptflow import format as fmt


def snapshot(state: dict) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": copy.deepcopy(state["optim"].state_dict()),
        "sched": copy.deepcopy(state["sched"].state_dict()),
        "extra": copy.deepcopy(state["extra"]),
    }


def assert_state_equals(state: dict, snap: dict) -> None:
    model_sd = state["model"].state_dict()
    assert model_sd.keys() == snap["model"].keys()
    for k, v in snap["model"].items():
        assert torch.equal(model_sd[k], v), f"model tensor {k} differs"

    optim_sd = state["optim"].state_dict()
    assert optim_sd["param_groups"] == snap["optim"]["param_groups"]
    assert optim_sd["state"].keys() == snap["optim"]["state"].keys()
    assert snap["optim"]["state"], "the snapshot should hold real AdamW state"
    for pid, pstate in snap["optim"]["state"].items():
        assert set(optim_sd["state"][pid]) == set(pstate)
        for name, val in pstate.items():
            got = optim_sd["state"][pid][name]
            if isinstance(val, torch.Tensor):
                assert torch.equal(torch.as_tensor(got), val), f"optim state {pid}.{name} differs"
            else:
                assert got == val, f"optim state {pid}.{name} differs"

    assert state["sched"].state_dict() == snap["sched"]
    assert state["extra"] == snap["extra"]


def manifest_path(root: str, run: str, step: int) -> str:
    return os.path.join(root, *fmt.manifest_key(run, step).split("/"))
