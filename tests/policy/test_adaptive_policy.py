"""``SavePolicy.adaptive``: the interval follows the measured costs within the overhead bound."""

import math

import pytest

from ckptflow import SavePolicy
from ckptflow.policy.adaptive import AdaptivePolicy
from ckptflow.policy.interval import daly

H = 3600.0


def _feed(policy: AdaptivePolicy, *, blocked_s: float, step_s: float, saves: int = 30, start: int = 0) -> int:
    step = start
    for _ in range(saves):
        assert policy.kind_for(step) is not None  # each measured save happens where the policy says
        policy.observe(step, blocked_s=blocked_s, step_time_s=step_s)
        step += policy.every
    return step


def test_before_anything_is_measured_it_saves_at_once_then_every_initial_interval():
    policy = SavePolicy.adaptive(max_overhead=0.02, initial_every=50)
    assert policy.kind_for(7) == "full"
    policy.observe(7, blocked_s=1.0, step_time_s=None)  # no step time yet: the interval stays
    assert (policy.every, policy.kind_for(56), policy.kind_for(57)) == (50, None, "incremental")
    assert "initial interval" in policy.decision(57)["why"]


def test_a_cheap_save_goes_to_dalys_optimum():
    policy = SavePolicy.adaptive(max_overhead=0.02, mtbf_s=4 * H)
    _feed(policy, blocked_s=2.0, step_s=0.5)
    assert policy.every == math.ceil(daly(2.0, 4 * H) / 0.5)
    assert 2.0 / (policy.every * 0.5) <= 0.02  # within the bound
    assert policy.decision(0)["why"].startswith("Daly's optimum")


def test_a_dear_save_is_held_to_the_overhead_bound():
    policy = SavePolicy.adaptive(max_overhead=0.02, mtbf_s=H)
    _feed(policy, blocked_s=60.0, step_s=1.0)  # Daly: about 10 min; the bound: 50 min
    assert policy.every == math.ceil(60.0 / 0.02)
    assert policy.every > daly(60.0, H)
    decision = policy.decision(123)
    assert decision["why"].startswith("overhead bound") and decision["every_steps"] == policy.every
    assert decision["save_s"] == pytest.approx(60.0) and decision["step_time_s"] == pytest.approx(1.0)


def test_it_moves_when_the_costs_change_and_places_a_full_every_k_saves():
    policy = SavePolicy.adaptive(max_overhead=0.05, mtbf_s=H, full_every=3, max_every=400)
    step = _feed(policy, blocked_s=1.0, step_s=1.0)
    short = policy.every
    step = _feed(policy, blocked_s=30.0, step_s=1.0, start=step)
    assert policy.every > short and policy.every == 400 and "clipped" in policy.decision(0)["why"]
    kinds = []
    for _ in range(6):
        kinds.append(policy.kind_for(step))
        policy.observe(step, blocked_s=30.0, step_time_s=1.0)
        step += policy.every
    assert kinds.count("full") == 2 and kinds.count("incremental") == 4


@pytest.mark.parametrize(
    "bad",
    [{"max_overhead": 0.0}, {"max_overhead": 1.5}, {"mtbf_s": 0.0}, {"mtbf_s": math.inf}, {"full_every": 0}],
)
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError):
        SavePolicy.adaptive(**bad)


def test_an_infinite_mtbf_is_refused_when_the_policy_is_made_not_at_the_first_measured_save():
    """It used to pass construction, then the second save's ``observe`` raised OverflowError
    (Daly's interval infinite, no whole number of steps) inside the training loop."""
    with pytest.raises(ValueError, match="finite"):
        policy = SavePolicy.adaptive(mtbf_s=math.inf, initial_every=5)
        policy.observe(0, blocked_s=0.1, step_time_s=0.01)
