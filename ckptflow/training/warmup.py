"""Warm-up after a load: ease training back in when the restore was not the exact state lost.

After a fallback past damaged checkpoints, a lossy archive copy, or a restore that did not
fill the optimizer, the first steps at the full learning rate can undo what the restored
weights hold (Adam's moments are missing or from an older step). Opt in with
``restore(..., warmup=Warmup(...))`` or ``warm_up(result, state, Warmup(...))``:

- ``WarmupLR`` ramps each parameter group's learning rate linearly from ``start_factor``
  times the schedule back to the schedule over ``steps`` steps. It wraps the user's own
  scheduler (StepLR, cosine, ...): before each of its steps the schedule's own value is
  put back, so a chained formula sees what it would have without the warm-up, and the
  factor is applied after. It is ``Stateful`` (JSON), so a checkpoint saves it.
- ``reset_momentum`` zeroes momentum buffers and Adam's moments (not the step count).
- ``reseed``: when the RNG state could not be restored (a world-size change, a
  model-only checkpoint, CUDA states saved on another number of devices), every RNG is
  seeded from ``(seed, step, rank)``, deterministic per rank, and the report says so.

Only the state the user names is touched.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptflow.errors import UnsupportedStateError

if TYPE_CHECKING:
    from ckptflow.training.restore import RestoreResult

log = logging.getLogger("ckptflow")
MOMENTS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
WHEN = ("degraded", "always")


def check_start_factor(owner: str, start_factor: float) -> None:
    if not 0 < start_factor <= 1:
        raise ValueError(f"{owner}(start_factor=...) must be in (0, 1], got {start_factor!r}")


class WarmupLR:
    """Learning rate = the schedule's value x a factor rising linearly from ``start_factor``
    (at construction) to 1 after ``steps`` calls of ``step()``; then the schedule alone.
    Call ``step()`` where the wrapped ``scheduler``'s ``step()`` was called. Its state
    (``state_dict``) is its own counters and the schedule's current values; keep the
    wrapped scheduler in the checkpointed state as before."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, steps: int, start_factor: float = 0.1, scheduler: Any = None
    ):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"WarmupLR(steps=...) must be a positive number of steps, got {steps!r}")
        check_start_factor("WarmupLR", start_factor)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.steps, self.start_factor = steps, float(start_factor)
        self.done = 0
        self.scheduled = [float(g["lr"]) for g in optimizer.param_groups]
        self._apply()

    @property
    def factor(self) -> float:
        return self.start_factor + (1.0 - self.start_factor) * min(self.done, self.steps) / self.steps

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.scheduled):
            group["lr"] = lr * self.factor

    def step(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.scheduled):
            group["lr"] = lr  # the schedule's own value: a chained scheduler computes from it
        if self.scheduler is not None:
            self.scheduler.step()
        self.scheduled = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.done += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "start_factor": self.start_factor, "done": self.done, "scheduled": self.scheduled}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = {"steps", "start_factor", "done", "scheduled"}
        if not isinstance(state, Mapping) or set(state) != keys or len(state["scheduled"]) != len(self.scheduled):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise UnsupportedStateError(
                f"a WarmupLR state needs {sorted(keys)} with one scheduled rate per parameter group "
                f"({len(self.scheduled)}), got {got}: was this entry saved from a WarmupLR on the same optimizer?"
            )
        self.steps, self.start_factor, self.done = int(state["steps"]), float(state["start_factor"]), int(state["done"])
        self.scheduled = [float(x) for x in state["scheduled"]]
        self._apply()


def reset_momentum(optimizer: torch.optim.Optimizer) -> int:
    """Zero the momentum buffers and Adam's moments of every parameter (the step count
    stays); returns how many tensors were reset."""
    count = 0
    with torch.no_grad():
        for per_param in optimizer.state.values():
            for name in MOMENTS:
                value = per_param.get(name)
                if isinstance(value, torch.Tensor):
                    value.zero_()
                    count += 1
    return count


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that depends on ``(seed, step, rank)`` only (no process state)."""
    digest = hashlib.blake2b(f"ckptflow-reseed:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed python, numpy and torch (CUDA too) from ``(seed, step, rank)``; returns the seed used."""
    value = derived_seed(seed, step, rank)
    random.seed(value)
    np.random.seed(value % (1 << 32))
    torch.manual_seed(value)  # seeds every CUDA device too
    return value


@dataclass(frozen=True, kw_only=True)
class Warmup:
    """What to warm up after a load. ``steps`` > 0: ramp the LR of ``state[optimizer]``
    (wrapping ``state[scheduler]`` when named) from ``start_factor`` over that many steps.
    ``when`` "degraded" (the default): only after a fallback, a lossy copy or an optimizer
    the restore did not fill; "always": after every load. ``reset_momentum``: zero its
    moments too (same condition). ``seed``: reseed every RNG from (seed, step, rank) when
    the RNG state was not restored, whatever ``when`` says."""

    steps: int = 0
    start_factor: float = 0.1
    optimizer: str = "optim"
    scheduler: str | None = None
    when: str = "degraded"
    reset_momentum: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(f"Warmup(when=...) must be one of {WHEN}, got {self.when!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"Warmup(steps=...) must be a number of steps >= 0, got {self.steps!r}")
        # here too, not only by WarmupLR: that is made only after a degraded load, so a bad
        # factor would surface as an error in the middle of recovering from damage
        check_start_factor("Warmup", self.start_factor)

    def check_names(self, state: Mapping[str, Any]) -> None:
        """``UnsupportedStateError`` unless the entries this warm-up names are in ``state``.
        ``restore`` checks before it loads anything: after a load, the error would come in
        the middle of a recovery the log already called done."""
        if (self.steps or self.reset_momentum) and not isinstance(state.get(self.optimizer), torch.optim.Optimizer):
            raise UnsupportedStateError(
                f"Warmup(optimizer={self.optimizer!r}) names no optimizer in the state (it has {sorted(state)})"
            )
        if self.steps and self.scheduler is not None and self.scheduler not in state:
            # the ramp would run without the schedule, and the caller steps the ramp instead of it
            raise UnsupportedStateError(
                f"Warmup(scheduler={self.scheduler!r}) names no entry of the state (it has {sorted(state)}): "
                "name the scheduler's key, or leave scheduler=None for a constant learning rate"
            )


@dataclass(frozen=True, kw_only=True)
class WarmupReport:
    """What a warm-up did and why."""

    reasons: list[str] = field(default_factory=list)  # why the load was degraded (empty: it was exact)
    lr: WarmupLR | None = None  # the scheduler to step instead of the user's own (None: no ramp)
    momentum_reset: int = 0  # moment tensors zeroed
    reseeded: int | None = None  # the seed every RNG got, when the RNG state was not restored

    @property
    def applied(self) -> bool:
        return self.lr is not None or bool(self.momentum_reset) or self.reseeded is not None


def degraded(result: RestoreResult, optimizer: Any) -> list[str]:
    """Why a load was not the exact state lost, if it was not."""
    reasons = []
    if result.skipped:
        reasons.append(f"fell back past {len(result.skipped)} damaged checkpoint(s)")
    if result.lossy is not None:
        reasons.append("loaded a lossy archive copy")
    if isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state:
        reasons.append("the optimizer was not restored")
    return reasons


def warm_up(result: RestoreResult, state: Mapping[str, Any], warmup: Warmup, *, rank: int = 0) -> WarmupReport:
    """Apply ``warmup`` to ``state`` after ``result``'s load (on every rank)."""
    warmup.check_names(state)
    optimizer = state.get(warmup.optimizer)
    reasons = degraded(result, optimizer)
    act = warmup.when == "always" or bool(reasons)
    lr = moments = None
    if act and warmup.steps:
        scheduler = state.get(warmup.scheduler) if warmup.scheduler else None
        lr = WarmupLR(optimizer, steps=warmup.steps, start_factor=warmup.start_factor, scheduler=scheduler)  # type: ignore[arg-type]
    if act and warmup.reset_momentum:
        moments = reset_momentum(optimizer)  # type: ignore[arg-type]
    seeded = None
    if warmup.seed is not None and not result.rng_restored:
        seeded = reseed(warmup.seed, result.step, rank)
        log.warning("RNG state not restored for step %d: reseeded from (seed, step, rank=%d)", result.step, rank)
    if act and (lr or moments):
        log.warning("warming up after restoring step %d: %s", result.step, "; ".join(reasons) or "always")
    return WarmupReport(reasons=reasons, lr=lr, momentum_reset=moments or 0, reseeded=seeded)
