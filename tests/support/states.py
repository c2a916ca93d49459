"""Training states for tests: the tiny model state, and tagged states whose every tensor
says which checkpoint it holds (for crash and GC tests that must detect a mix)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ckptflow.state import to_state_dicts
from ckptflow.tree import flatten

RUN = "r"
CHUNK = 64  # bytes: every tagged tensor spans several chunks


def tiny_state(seed: int = 0, lr: float = 1e-2, *, optimizer: bool = True) -> dict:
    """A tiny model + AdamW + StepLR scheduler + a JSON value, deterministic in ``seed``
    (``optimizer=False``: the model alone)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    if not optimizer:
        return {"model": model}
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "extra": 0}


def tiny_train(state: dict, n: int = 1) -> None:
    """``n`` optimizer steps on random data (consumes torch RNG), then bump ``extra``."""
    model, optim, sched = state["model"], state["optim"], state.get("sched")
    for _ in range(n):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if sched is not None:
            sched.step()
    if isinstance(state.get("extra"), int):
        state["extra"] += n


def tensor_bytes(state: dict) -> int:
    """What a manifest's logical_bytes must be for ``state``: every tensor's bytes."""
    _, tensors = flatten(to_state_dicts(state))
    return sum(t.numel() * t.element_size() for t in tensors.values())


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


# ---- tagged states --------------------------------------------------------------------------
def tagged_state(tag: int) -> dict:
    """A state whose every tensor (and the JSON leaf) identifies the checkpoint ``tag``.

    ``shared`` is identical in every tag so incremental saves dedup it; tags 0 and 1 are
    never saved (0 = empty restore target).
    """
    return {
        "model": {
            "shared": torch.arange(48, dtype=torch.float32),
            "w": torch.arange(30, dtype=torch.float32) + 1000.0 * tag,
        },
        "z": torch.linspace(-1, 1, 40, dtype=torch.float64) * tag,
        "epoch": tag,
    }


def blank_state() -> dict:
    return {
        "model": {"shared": torch.full((48,), -7.0), "w": torch.full((30,), -7.0)},
        "z": torch.full((40,), -7.0, dtype=torch.float64),
        "epoch": None,
    }


def state_tag(state: dict) -> int:
    """Which tag ``state`` holds, asserting that it is exactly one tag's state (no mix)."""
    tag = state["epoch"]
    expected = tagged_state(tag)
    assert torch.equal(state["model"]["shared"], expected["model"]["shared"])
    assert torch.equal(state["model"]["w"], expected["model"]["w"]), f"weights w are not those of tag {tag}"
    assert torch.equal(state["z"], expected["z"]), f"tensor z is not that of tag {tag}"
    return tag
