"""Training states for tests: the tiny model state, and tagged states whose every tensor
says which checkpoint it holds (for crash and GC tests that must detect a mix)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ckptflow.format.state_tree import flatten
from ckptflow.training.state import to_state_dicts

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


# ---- drifting states (delta codec) ------------------------------------------------------------
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
DRIFT_CHUNK = 64 << 10  # bytes: the large tensors span several chunks, each above the encoder's sample


def drifting_state(step: int, *, dtypes: bool = True) -> dict:
    """What training looks like to the delta codec, deterministic in ``step``: weights
    that move a little every step (deltas win), a tensor redrawn every step (noise:
    plain wins), an untouched one (dedup), and one small tensor of every dtype."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64 << 10, generator=gen) * 0.02
    drift = torch.randn(64 << 10, generator=gen) * 1e-5
    state = {
        "model": {
            "w": base + drift * step,
            "frozen": torch.arange(4096, dtype=torch.float32),
        },
        "noise": torch.randn(16 << 10, generator=torch.Generator().manual_seed(1000 + step)),
        "step": step,
    }
    if dtypes:
        small = torch.linspace(-3, 3, 3001) + 0.001 * step
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            state["model"][name] = (small > 0) if dtype == torch.bool else (small * 40).to(dtype)
    return state


def blank_like(state: dict) -> dict:
    """Same structure, every tensor zeroed (a restore target that must be fully overwritten)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = blank_like(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = None
    return out


def assert_tensors_equal(expected: dict, actual: dict) -> None:
    """Bit-exact: same keys, same dtypes, same bytes (NaN-safe)."""
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_tensors_equal(value, actual[key])
        elif isinstance(value, torch.Tensor):
            got = actual[key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), f"{key} differs"
        else:
            assert actual[key] == value, key


def model_at(step: float) -> nn.Module:
    """A model whose every value says which step it holds."""
    model = nn.Linear(16, 16)
    with torch.no_grad():
        model.weight.fill_(step)
        model.bias.fill_(step)
    return model
