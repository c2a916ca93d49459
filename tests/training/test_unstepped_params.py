"""A parameter the saved optimizer never updated (a BERT pooler no gradient reached) has no
optimizer state in the checkpoint. Restoring it used to fail with torch's raw RuntimeError
(a live optimizer that had stepped) or a StateMismatchError (a fresh one); now the
parameter ends with no state, as in the run that saved it, and training goes on identically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer


def make():
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(4, 4), "pooler": nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optim, *, pooler: bool, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(2, 4)
    loss = model["enc"](x).sum() + (model["pooler"](x).sum() if pooler else 0)
    optim.zero_grad()
    loss.backward()
    optim.step()


@pytest.mark.parametrize("live_stepped", [False, True], ids=["fresh optimizer", "stepped optimizer"])
def test_a_parameter_with_no_saved_optimizer_state_restores_without_state(tmp_path, live_stepped):
    model, optim = make()
    train(model, optim, pooler=False, seed=1)
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, {"model": model, "optim": optim})
        live_model, live_optim = make()
        if live_stepped:
            train(live_model, live_optim, pooler=False, seed=5)
        ck.restore({"model": live_model, "optim": live_optim})
    assert live_model["pooler"].weight not in live_optim.state
    assert live_model["enc"].weight in live_optim.state
    train(model, optim, pooler=True, seed=2)  # the pooler's first update, in both
    train(live_model, live_optim, pooler=True, seed=2)
    for (name, a), b in zip(model.named_parameters(), live_model.parameters()):
        assert torch.equal(a, b), name
