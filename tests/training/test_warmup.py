"""Warm-up after a load: the LR ramps exactly as specified, composes with the user's own
scheduler (StepLR, cosine), survives a save and restore; momentum resets on request; the
RNGs are reseeded deterministically per (seed, step, rank) when their state was not restored;
``restore(..., warmup=...)`` acts only on a degraded load unless told otherwise."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, Warmup, WarmupLR, open_store
from ckptflow.catalog import recovery_log
from ckptflow.errors import UnsupportedStateError
from ckptflow.training.warmup import derived_seed, reseed
from support.corrupt import chunk_path, flip_byte, only_in


def sgd(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr)


def lrs(sched, n: int) -> list[float]:
    out = [sched.get_last_lr()[0] if isinstance(sched, WarmupLR) else sched.optimizer.param_groups[0]["lr"]]
    for _ in range(n):
        sched.optimizer.step()
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def test_the_lr_ramps_linearly_from_the_fraction_back_to_the_schedule():
    warm = WarmupLR(sgd(1.0), steps=4, start_factor=0.2)
    assert lrs(warm, 6) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0], abs=1e-15)


def test_it_composes_with_step_lr_exactly():
    optim = sgd(1.0)
    warm = WarmupLR(optim, steps=4, start_factor=0.2, scheduler=torch.optim.lr_scheduler.StepLR(optim, 2, gamma=0.5))
    # schedule 1, 1, .5, .5, .25, .25 times factors .2, .4, .6, .8, 1, 1
    assert lrs(warm, 5) == pytest.approx([0.2, 0.4, 0.3, 0.4, 0.25, 0.25], abs=1e-15)


def test_it_composes_with_cosine_as_the_schedule_alone_would_run():
    optim, twin = sgd(0.5), sgd(0.5)
    cosine = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.01)
    warm = WarmupLR(optim, steps=3, start_factor=0.5, scheduler=cosine(optim))
    plain = lrs(cosine(twin), 12)
    ramped = lrs(warm, 12)
    factors = [0.5, 2 / 3, 5 / 6] + [1.0] * 10
    assert ramped == pytest.approx([p * f for p, f in zip(plain, factors)], rel=1e-12)
    assert ramped[3:] == plain[3:]  # after the warm-up: the schedule exactly, no drift


def plain_state():
    """The training state without a warm-up: model, AdamW at lr 0.1, StepLR."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optim": optim, "sched": torch.optim.lr_scheduler.StepLR(optim, 3, gamma=0.5)}


def train_state():
    state = plain_state()
    return {**state, "warmup": WarmupLR(state["optim"], steps=5, scheduler=state["sched"])}


def run(state, n):
    out = []
    for _ in range(n):
        state["model"](torch.ones(1, 4)).sum().backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["warmup"].step()
        out.append(state["optim"].param_groups[0]["lr"])
    return out


def test_its_state_survives_a_save_and_restore(tmp_path):
    state = train_state()
    run(state, 2)
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(2, state)
        resumed = train_state()
        ck.restore(resumed)
    assert resumed["warmup"].state_dict() == state["warmup"].state_dict()
    assert resumed["warmup"].done == 2
    assert run(resumed, 6) == run(state, 6)  # mid-ramp and past it: the same rates


def test_reseeding_is_deterministic_per_seed_step_and_rank():
    def draws(seed, step, rank):
        reseed(seed, step, rank)
        return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()

    assert draws(7, 100, 0) == draws(7, 100, 0)
    assert draws(7, 100, 0) != draws(7, 100, 1) != draws(7, 101, 1)
    assert draws(7, 100, 0) != draws(8, 100, 0)
    assert derived_seed(7, 100, 0) == derived_seed(7, 100, 0) < 1 << 63


def saved_with_damage(tmp_path):
    """Steps 1 and 2 of a trained AdamW state (no RNG state), step 2 damaged; the store's root."""
    root = str(tmp_path / "store")
    state = plain_state()
    with Checkpointer(root, "r") as ck:
        for step in (1, 2):
            state["model"](torch.ones(1, 4)).sum().backward()
            state["optim"].step()
            ck.save(step, state, rng=False)
    flip_byte(chunk_path(root, only_in(root, "r", 2, 1)[0]))
    return root


def test_restore_warms_up_only_a_degraded_load_and_reseeds_when_rng_was_not_saved(tmp_path):
    root = saved_with_damage(tmp_path)
    warmup = Warmup(steps=4, start_factor=0.25, optimizer="optim", reset_momentum=True, seed=11)
    live = plain_state()
    with Checkpointer(root, "r") as ck:
        result = ck.restore(live, warmup=warmup)
        assert result.step == 1 and result.warmup.reasons == ["fell back past 1 damaged checkpoint(s)"]
        assert result.warmup.lr is not None and live["optim"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
        moments = [s["exp_avg"] for s in live["optim"].state.values()]
        assert result.warmup.momentum_reset == 4 and all(not m.any() for m in moments)
        assert result.warmup.reseeded == derived_seed(11, 1, 0)
        expected = (reseed(11, 1, 0), torch.rand(2))[1]
        reseed(11, 1, 0)
        assert torch.equal(torch.rand(2), expected)

        exact = plain_state()
        result = ck.restore(exact, step=1, warmup=Warmup(steps=4, optimizer="optim"))
        assert result.warmup.reasons == [] and result.warmup.lr is None and not result.warmup.applied
        assert exact["optim"].param_groups[0]["lr"] == pytest.approx(0.1)  # an exact load is left alone
        always = plain_state()
        result = ck.restore(always, step=1, warmup=Warmup(steps=2, optimizer="optim", when="always"))
        assert result.warmup.lr is not None and always["optim"].param_groups[0]["lr"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="when"):
        Warmup(when="sometimes")


def test_a_bad_warmup_is_refused_before_a_load_needs_it_not_after_a_degraded_one(tmp_path):
    """``start_factor`` was checked only by WarmupLR, made only after a degraded load, so a
    bad one raised in the middle of a recovery from damage; a scheduler named but absent
    was ignored (the ramp ran without the schedule, and the caller steps the ramp instead)."""
    with pytest.raises(ValueError, match="start_factor"):
        Warmup(steps=4, start_factor=2.0)
    with pytest.raises(ValueError, match="start_factor"):
        Warmup(steps=4, start_factor=0.0)
    root = str(tmp_path)
    with Checkpointer(root, "r") as ck:
        ck.save(1, plain_state())
        fresh = plain_state()
        with torch.no_grad():
            fresh["model"].weight.zero_()
        with pytest.raises(UnsupportedStateError, match="scheduler='schedule'"):  # the key is "sched"
            ck.restore(fresh, warmup=Warmup(steps=4, scheduler="schedule", when="always"))
    # refused before anything was loaded or a recovery recorded (it was after both)
    assert not fresh["model"].weight.any() and recovery_log.read_all(open_store(root), "r") == []
