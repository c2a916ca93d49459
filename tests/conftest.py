"""Shared pytest fixtures."""


# ---------------------------------------------------------------------------
# Fixtures for test_checkpointer.py / test_corruption.py / test_store.py
# (tiny training state + a train-step helper). Names start with "tiny_" / "ckpt_".
# ---------------------------------------------------------------------------
import pytest as _pytest_tiny
import torch as _torch_tiny


def _tiny_build_state(seed: int = 0, lr: float = 1e-2) -> dict:
    """A tiny model + AdamW + StepLR scheduler + a JSON value, deterministic in ``seed``."""
    _torch_tiny.manual_seed(seed)
    model = _torch_tiny.nn.Sequential(
        _torch_tiny.nn.Linear(8, 32), _torch_tiny.nn.ReLU(), _torch_tiny.nn.Linear(32, 4)
    )
    optim = _torch_tiny.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = _torch_tiny.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "extra": 0}


def _tiny_train_step(state: dict, n: int = 1) -> None:
    """``n`` optimizer steps on random data (consumes torch RNG), then bump ``extra``."""
    model, optim, sched = state["model"], state["optim"], state["sched"]
    for _ in range(n):
        x = _torch_tiny.randn(16, 8)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
    if isinstance(state.get("extra"), int):
        state["extra"] += n


@_pytest_tiny.fixture
def tiny_state_factory():
    """Call as ``tiny_state_factory(seed=0)`` -> {"model", "optim", "sched", "extra"}."""
    return _tiny_build_state


@_pytest_tiny.fixture
def tiny_train_step():
    """Call as ``tiny_train_step(state, n=1)``: n AdamW steps + scheduler steps."""
    return _tiny_train_step


@_pytest_tiny.fixture
def ckpt_store_dir(tmp_path):
    """A fresh store root directory (inside pytest's tmp_path)."""
    return str(tmp_path / "store")
