"""``advise``'s current interval for a run under ``SavePolicy.adaptive``: every manifest
records the decision that saved its step (``save_decision``), so the interval the policy
saves at now is read there, not guessed from the gaps of a history it may have left."""

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.reports.advice import advise
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
    assert "gap" in advice.sources["current"]
