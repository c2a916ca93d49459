"""``advise``'s step time: the run's pace now, read from its newest saves, as its current
interval is, not the median over a history whose pace has since changed."""

import pytest

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.reports.advice import advise
from support.save_timing import chosen_save_timing
from support.states import RUN, tiny_state, tiny_train


def _trained(root: str, timing, phases: list[tuple[float, range]], policy: SavePolicy) -> None:
    state = tiny_state()
    with Checkpointer(root, RUN, policy=policy) as ckpt:
        for step_s, steps in phases:
            timing.step_s = step_s
            for step in steps:
                tiny_train(state)
                timing.train()
                ckpt.save(step, state)


def test_a_run_whose_steps_slowed_is_priced_at_its_step_time_now(tmp_path, monkeypatch):
    """1 s a step for 1,000 steps, then 3 s (saves every 100 steps, a full every 500): the
    median over the whole history, 10 measurements of 1 s against 5 of 3 s, priced the run
    at 1 s a step, so its current 100 steps read as 100 s of training and the optimum's
    steps came out three times too many."""
    root = str(tmp_path)
    timing = chosen_save_timing(monkeypatch, save_s=2.0, step_s=1.0)
    policy = SavePolicy(full_every=500, incremental_every=100)
    _trained(root, timing, [(1.0, range(1001)), (3.0, range(1001, 1501))], policy)
    advice = advise(open_store(root), RUN, mtbf_s=86400.0)
    assert advice.inputs.step_time_s == pytest.approx(3.0), advice.sources["step_time_s"]
    assert advice.current is not None and advice.current.interval_s == pytest.approx(300.0)
    assert advice.sources["step_time_s"] == "median of the newest 3 of 15 (manifests)", advice.sources


def test_an_adaptive_run_whose_steps_slowed_is_priced_at_its_step_time_now(tmp_path, monkeypatch):
    """The newest save's decision says the interval (``save_decision``); the step time it
    is priced at is the newest saves' too, not the history's median (1 s a step)."""
    root = str(tmp_path)
    timing = chosen_save_timing(monkeypatch, save_s=2.0, step_s=1.0)
    policy = SavePolicy.adaptive(initial_every=50, min_every=50, max_every=50, full_every=5)
    _trained(root, timing, [(1.0, range(801)), (3.0, range(801, 1101))], policy)
    advice = advise(open_store(root), RUN, mtbf_s=86400.0)
    assert "save_decision" in advice.sources["current"]
    assert advice.inputs.step_time_s == pytest.approx(3.0), advice.sources["step_time_s"]
    assert advice.current is not None and advice.current.interval_s == pytest.approx(150.0)


def test_a_single_slow_save_among_the_newest_does_not_move_the_step_time(tmp_path, monkeypatch):
    """One measurement of the newest three (a step slowed by a neighbour's job) is outvoted."""
    root = str(tmp_path)
    timing = chosen_save_timing(monkeypatch, save_s=2.0, step_s=1.0)
    policy = SavePolicy(full_every=500, incremental_every=100)
    _trained(root, timing, [(1.0, range(801)), (5.0, range(801, 901)), (1.0, range(901, 1001))], policy)
    advice = advise(open_store(root), RUN, mtbf_s=86400.0)
    assert advice.inputs.step_time_s == pytest.approx(1.0), advice.sources["step_time_s"]
