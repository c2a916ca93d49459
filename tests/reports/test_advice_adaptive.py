"""``advise``'s current interval for a run under ``SavePolicy.adaptive``: every manifest
records the decision that saved its step (``save_decision``), so the interval the policy
saves at now is read there, not guessed from the gaps of a history it may have left."""

import re

import pytest

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.policy.interval import MAX_FULL_EVERY
from ckptflow.reports.advice import advise
from support.corrupt import reseal_manifest
from support.states import RUN, tiny_state, tiny_train


def _saved_every(root: str, phases: list[tuple[int, range]], *, full_every: int) -> None:
    """An adaptive run held at each interval in turn (``min_every`` = ``max_every``), as a
    job restarted with new bounds, or whose measurements moved the interval, saves."""
    state = tiny_state()
    for every, steps in phases:
        policy = SavePolicy.adaptive(initial_every=every, min_every=every, max_every=every, full_every=full_every)
        with Checkpointer(root, RUN, policy=policy) as ckpt:
            for step in steps:
                tiny_train(state)
                ckpt.save(step, state)


def test_an_adaptive_run_whose_interval_grew_is_read_at_the_interval_it_saves_at_now(tmp_path):
    """Every 100 steps to step 2000, then every 500 to step 6001 (a full every 10 saves
    throughout): the history's gaps, 20 of 100 and 8 of 500, were read as every 100 steps
    with a full every 7 saves, a fifth of the interval the policy saves at, so the advice
    told a run that already checkpointed less often to do so. The newest save's decision
    says every 500 steps, a full every 10 saves."""
    root = str(tmp_path)
    _saved_every(root, [(100, range(2001)), (500, range(2001, 6002))], full_every=10)
    newest = max(catalog.committed(open_store(root), RUN), key=lambda m: m.step)
    assert newest.step == 6001 and newest.extra["save_decision"]["every_steps"] == 500
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 500, advice.current
    assert advice.current_full_every == 10
    assert "save_decision" in advice.sources["current"]


def test_a_run_that_left_the_adaptive_policy_is_read_by_its_gaps(tmp_path):
    """The newest save records no decision (a fixed policy now): its gaps say the interval,
    not a decision an older save of the adaptive policy recorded."""
    root = str(tmp_path)
    _saved_every(root, [(100, range(1001))], full_every=4)
    state = tiny_state()
    with Checkpointer(root, RUN, policy=SavePolicy(full_every=100, incremental_every=20)) as ckpt:
        for step in range(1001, 1501):
            tiny_train(state)
            ckpt.save(step, state)
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 20
    assert advice.current_full_every == 5
    assert re.fullmatch(r"the median of the gaps between the newest \d+ commits, made alike \(manifests\)",
                        advice.sources["current"]), advice.sources["current"]  # fmt: skip


def _newest_decision_set(root: str, **fields) -> None:
    """Rewrite the newest save's decision as an older or buggy writer might have (sealed again)."""
    newest = max(catalog.committed(open_store(root), RUN), key=lambda m: m.committed_at)
    reseal_manifest(root, RUN, newest.step, lambda record: record["save_decision"].update(fields))


@pytest.mark.parametrize("every_steps", [10**400, 10**fmt.STEP_DIGITS], ids=["past-a-float", "past-the-last-step"])
def test_a_decision_with_an_interval_no_run_can_save_at_is_read_by_the_gaps(tmp_path, every_steps):
    """A decision of 10**400 steps (JSON holds any whole number) raised OverflowError
    (int too large to convert to float) out of ``advise``: ``ckptflow advise`` printed a
    traceback and the ``checkpoint_advice`` asset, which passes over a run's CkptflowError
    only, failed for every run. No two saves are further apart than the largest step
    (10**12 steps was read as the run's interval): such a decision is not of the shape
    ckptflow writes, and the gaps say the interval."""
    root = str(tmp_path)
    _saved_every(root, [(100, range(1001))], full_every=4)
    _newest_decision_set(root, every_steps=every_steps)
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 100
    assert "gap" in advice.sources["current"]


def test_a_decision_with_a_full_every_past_any_float_is_priced_at_the_most_the_model_prices(tmp_path):
    """``full_every`` 10**400 (a policy that never saves a full again, as a buggy writer
    puts it) raised OverflowError rounding it; the model prices at most a full every
    ``MAX_FULL_EVERY`` checkpoints, as it does for any longer cycle."""
    root = str(tmp_path)
    _saved_every(root, [(100, range(1001))], full_every=4)
    _newest_decision_set(root, full_every=10**400)
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 100
    assert advice.current_full_every == MAX_FULL_EVERY
