"""A failed or rejected operation changes nothing: a restore that does not succeed, and
any save, leave the training state bit for bit as it was (fresh optimizers included:
DCP initialises a fresh optimizer's state to have tensors to save or load into)."""

from __future__ import annotations

import copy

import pytest
import torch

import ckptflow
from ckptflow import Checkpointer, NoValidCheckpointError
from support.corrupt import flip_byte
from support.states import tiny_state, tiny_train


def exact(state: dict) -> dict:
    """Everything training depends on, copied: weights, gradients, optimizer state and groups."""
    optim = state["optim"]
    return {
        "params": [p.detach().clone() for p in state["model"].parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in state["model"].parameters()],
        "optim": copy.deepcopy(optim.state_dict()),
        "opt_called": vars(optim).get("_opt_called", "unset"),
        "sched": copy.deepcopy(state["sched"].state_dict()),
    }


def assert_exact(state: dict, before: dict) -> None:
    now = exact(state)
    assert all(torch.equal(a, b) for a, b in zip(now["params"], before["params"]))
    assert [g is None for g in now["grads"]] == [g is None for g in before["grads"]]
    assert now["optim"]["state"].keys() == before["optim"]["state"].keys()
    assert now["optim"]["param_groups"] == before["optim"]["param_groups"]
    assert now["opt_called"] == before["opt_called"] and now["sched"] == before["sched"]


def losses_after(state: dict, steps: int = 3) -> list[float]:
    torch.manual_seed(123)
    out = []
    for _ in range(steps):
        loss = state["model"](torch.randn(16, 8)).pow(2).mean()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["sched"].step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("store", ["empty", "all-rejected"])
def test_a_restore_that_finds_nothing_leaves_a_fresh_optimizer_fresh(tmp_path, store):
    root = str(tmp_path / "store")
    if store == "all-rejected":
        with Checkpointer(root, "r") as ck:
            saved = tiny_state(seed=1)
            tiny_train(saved, 2)
            ck.save(1, saved)
        for path in (tmp_path / "store" / "chunks").rglob("*"):
            if path.is_file():
                flip_byte(path)
    state, reference = tiny_state(seed=0), tiny_state(seed=0)
    before = exact(state)
    with Checkpointer(root, "r") as ck, pytest.raises(NoValidCheckpointError):
        ck.restore(state)
    assert not state["optim"].state  # still fresh: DCP's initialisation was undone
    assert_exact(state, before)
    assert losses_after(state) == losses_after(reference)  # training goes on as if restore was never called


@pytest.mark.parametrize("per_rank", [False, True], ids=["optimizer", "per-rank optimizer"])
def test_a_save_before_the_first_step_changes_nothing_and_restores_a_fresh_optimizer(tmp_path, per_rank):
    root = str(tmp_path / "store")
    state, reference = tiny_state(seed=0), tiny_state(seed=0)
    before = exact(state)
    saved = {**state, "optim": ckptflow.per_rank(state["optim"])} if per_rank else state
    with Checkpointer(root, "r") as ck:
        ck.save(0, saved)
        ck.save(1, saved, blocking=False).wait()
    assert not state["optim"].state
    assert_exact(state, before)
    assert losses_after(state) == losses_after(reference)

    resumed = tiny_state(seed=5)
    tiny_train(resumed, 2)  # a live optimizer with state, restored to the fresh one saved at step 1
    with Checkpointer(root, "r") as ck:
        assert ck.restore(resumed).step == 1
    assert not resumed["optim"].state
    assert losses_after(resumed) == losses_after(tiny_state(seed=0))


def test_a_save_after_training_does_not_touch_the_state(tmp_path):
    state = tiny_state(seed=0)
    tiny_train(state, 2)
    state["model"](torch.randn(2, 8)).sum().backward()  # gradients pending, as mid-step
    before = exact(state)
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.save(1, state)
        ck.save(2, state, blocking=False).wait()
    assert_exact(state, before)
    assert all(
        torch.equal(a["exp_avg"], b["exp_avg"])
        for a, b in zip(state["optim"].state_dict()["state"].values(), before["optim"]["state"].values())
    )
