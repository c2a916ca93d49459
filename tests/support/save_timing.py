"""Save timings a test chooses: the clock a ``Checkpointer`` times its saves by (the
``save_cost`` record each manifest carries) moved only as the test says, so what the advice
reads from the store is the same on a loaded machine as on an idle one."""

from __future__ import annotations

import importlib
import types

import pytest

from ckptflow.dcp import save_clock


class SaveTiming:
    """``time.perf_counter`` as the checkpointer and its save clock read it: each save holds
    training ``save_s`` (blocked time and duration alike), and ``train`` moves the clock on
    by ``step_s`` a step."""

    def __init__(self, *, save_s: float, step_s: float):
        self.save_s, self.step_s = save_s, step_s
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def train(self, steps: int = 1) -> None:
        self.now += steps * self.step_s


def chosen_save_timing(monkeypatch: pytest.MonkeyPatch, *, save_s: float, step_s: float) -> SaveTiming:
    """Times this test's saves by a ``SaveTiming`` (undone with ``monkeypatch``)."""
    timing = SaveTiming(save_s=save_s, step_s=step_s)
    clock = types.SimpleNamespace(perf_counter=timing.perf_counter)
    monkeypatch.setattr(save_clock, "time", clock)
    monkeypatch.setattr(importlib.import_module("ckptflow.training.checkpointer"), "time", clock)
    since = save_clock.SaveClock.since.__func__  # type: ignore[attr-defined]

    def timed(cls, resumed, step, *, blocking):
        started = since(cls, resumed, step, blocking=blocking)
        timing.now += save_s  # the save holds training from here until it returns
        return started

    monkeypatch.setattr(save_clock.SaveClock, "since", classmethod(timed))
    return timing
