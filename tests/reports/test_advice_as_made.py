"""``advise``'s reading of the run's current interval and full/incremental mix: the
history as the run made it (``ckptflow.reports.advice._as_made``), through retention's
thinning and the run's own changes of policy."""

import pytest

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.catalog.checkpoints import list_checkpoints
from ckptflow.reports.advice import advise
from support.cli import run_cli
from support.retention_history import thinned_by_retention
from support.states import RUN, tiny_state, tiny_train


@pytest.mark.parametrize(("full_every", "incremental_every", "saves_per_full"), [(9, 2, 5), (7, 3, 3), (3 * 2, 2, 3)])
def test_the_current_mix_is_the_checkpoints_per_full_cycle_the_run_made(
    tmp_path, capsys, full_every, incremental_every, saves_per_full
):
    """The current FULL EVERY was round(median full gap / median gap): fulls every 9 steps and
    saves every 2 (0, 2, 4, 6, 8, 9F, 10, ...: 5 saves a cycle) was round(4.5) = 4 by Python's
    half-to-even, and fulls every 7, saves every 3 (0, 3, 6, 7F, 9, 12, 14F: 3 a cycle)
    round(2.33) = 2; the current interval was priced at that wrong mix. It is now counted over
    the run's whole full cycles. ``SavePolicy(full_every=K * N, incremental_every=N)``, the
    advice applied (docs/checkpoint-interval.md), reads back as K."""
    root = str(tmp_path / "store")
    state = tiny_state()
    policy = SavePolicy(full_every=full_every, incremental_every=incremental_every)
    with Checkpointer(root, RUN, policy=policy) as ckpt:
        for step in range(3 * full_every + 1):
            tiny_train(state)
            ckpt.save(step, state)
    advice = advise(open_store(root), RUN)
    assert advice.current_full_every == saves_per_full and advice.current is not None
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN)
    (current,) = [line.split() for line in out.splitlines() if line.startswith("current")]
    (optimal,) = [line.split() for line in out.splitlines() if line.startswith("optimal")]
    assert code == 0 and current[4] == str(saves_per_full), out  # FULL EVERY, after the 3 words of TIME
    assert optimal[4] == str(advice.full_every) == str(advice.inputs.full_every), out  # shown as priced


def test_a_history_retention_thinned_to_its_fulls_keeps_the_runs_mix(tmp_path, capsys):
    """Retention keeps fulls longer than incrementals (30 days against 7 by default), so the
    older cycles of a run past a week hold their full alone. Counted over every cycle, a run
    saving every 2 steps with a full every 10 (5 checkpoints a cycle) read as a full every 2
    once its first 70 steps were thinned, and its current interval was priced at that mix.
    A cycle thinned to its full says nothing of the mix: it is left out."""
    root = str(tmp_path)
    expired = thinned_by_retention(root, SavePolicy(full_every=10, incremental_every=2), last_week_from=70)
    assert expired == [s for s in range(0, 70, 2) if s % 10]
    advice = advise(open_store(root), RUN)
    assert advice.current_full_every == 5 and advice.current is not None and advice.current.interval_steps == 2
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN)
    (current,) = [line.split() for line in out.splitlines() if line.startswith("current")]
    assert code == 0 and current[4] == "5", out  # FULL EVERY, after the 3 words of TIME


def test_a_history_retention_thinned_to_its_fulls_keeps_the_runs_interval(tmp_path):
    """The current interval is the run's gap between commits now. A run saving every step
    with a full every 2 has, once retention expired the incrementals older than a week,
    gaps of 2 over its thinned past and of 1 over its last week: the median over the whole
    history read 2 steps once the thinned past was the longer. Only the newest cycles that
    hold incrementals are as the run made it."""
    root = str(tmp_path)
    expired = thinned_by_retention(root, SavePolicy(full_every=2, incremental_every=1), last_week_from=80)
    assert expired == list(range(1, 80, 2))
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 1
    assert advice.current_full_every == 2


def test_an_old_checkpoint_retention_keeps_as_the_best_does_not_bring_the_thinned_history_back(tmp_path):
    """Best-K keeps the best checkpoint however old: an incremental at step 11 of a run saving
    every step with a full every 2 survives the week's thinning. The history from the full
    before it on held 35 thinned cycles (gaps of 2) against the 20 saves of the last week
    (gaps of 1): read as every 2 steps. Only the newest unbroken stretch of whole cycles
    holding more than their full is as the run made it."""
    root = str(tmp_path)
    expired = thinned_by_retention(root, SavePolicy(full_every=2, incremental_every=1), last_week_from=80, best=11)
    assert expired == [s for s in range(1, 80, 2) if s != 11]
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 1
    assert advice.current_full_every == 2


def test_an_old_cycle_retention_keeps_as_the_best_does_not_count_in_the_mix(tmp_path):
    """Saves every 2 steps, a full every 10 (5 checkpoints a cycle); step 12 is kept as the
    best past the week's thinning, so its cycle holds 2: counted among the 3 whole cycles of
    the last week, the mix read (2 + 5 + 5 + 5) / 4 = 4.25, a full every 4."""
    root = str(tmp_path)
    expired = thinned_by_retention(root, SavePolicy(full_every=10, incremental_every=2), last_week_from=70, best=12)
    assert expired == [s for s in range(0, 70, 2) if s % 10 and s != 12]
    advice = advise(open_store(root), RUN)
    assert advice.current_full_every == 5 and advice.current is not None and advice.current.interval_steps == 2


@pytest.mark.parametrize(("last_week_from", "best"), [(76, None), (76, 62)])
def test_a_cycle_retention_cut_into_does_not_count_in_the_mix(tmp_path, last_week_from, best):
    """Saves every 2 steps, a full every 10 (5 checkpoints a cycle): a week after step 76
    retention has cut into the cycle of the full at 70 (70 and 78 held), the oldest of the
    newest cycles holding incrementals; counted with them it read (2 + 5 + 5) / 3, a full
    every 4. Step 62 kept as the best before it joins that stretch too (2 + 2 + 5 + 5)."""
    root = str(tmp_path)
    expired = thinned_by_retention(
        root, SavePolicy(full_every=10, incremental_every=2), last_week_from=last_week_from, best=best
    )
    assert expired == [s for s in range(0, last_week_from + 1, 2) if s % 10 and s != best]
    advice = advise(open_store(root), RUN)
    assert advice.current_full_every == 5 and advice.current is not None and advice.current.interval_steps == 2


@pytest.mark.parametrize(("last_week_from", "steps"), [(85, 100), (95, 110)], ids=["whole cycles thinned", "cut into"])
def test_a_cycle_longer_than_the_week_retention_keeps_is_read_by_its_fulls_distance(tmp_path, last_week_from, steps):
    """Saves every step, a full every 20. A week after step 85 every whole cycle holds its
    full alone, and only the cycle under way (the full at 80, then 86 to 99) holds the run's
    incrementals: counted over the whole cycles, the mix read a full every 1 (fulls alone).
    A week after step 95 the cycle of the full at 80 holds 80 and 96 to 99 (5), the cycle
    under way 100 to 109: read as a full every 5. The fulls are 20 steps apart and the run
    saves every step: a full every 20."""
    root = str(tmp_path)
    policy = SavePolicy(full_every=20, incremental_every=1)
    expired = thinned_by_retention(root, policy, last_week_from=last_week_from, steps=steps)
    assert expired == [s for s in range(last_week_from + 1) if s % 20]
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 1
    assert advice.current_full_every == 20


def test_a_run_that_now_saves_fulls_alone_reads_so(tmp_path):
    """Saves every 2 steps with a full every 10 up to step 60, then fulls alone every 10 to
    step 120: the newest cycles hold their full alone, and the history as a whole read every
    2 steps, a full every 3. The run checkpoints every 10 steps now, each a full."""
    root = str(tmp_path)
    state = tiny_state()
    for policy, steps in [
        (SavePolicy(full_every=10, incremental_every=2), range(60)),
        (SavePolicy(full_every=10), range(60, 121)),
    ]:
        with Checkpointer(root, RUN, policy=policy) as ckpt:
            for step in steps:
                tiny_train(state)
                ckpt.save(step, state)
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 10
    assert advice.current_full_every == 1


def _saved_under(root: str, policies: list[tuple[SavePolicy, range]]) -> None:
    """A run checkpointing under each policy in turn, as a job restarted with a new one does."""
    state = tiny_state()
    for policy, steps in policies:
        with Checkpointer(root, RUN, policy=policy) as ckpt:
            for step in steps:
                tiny_train(state)
                ckpt.save(step, state)


def test_a_run_that_changed_its_mix_is_read_by_its_newest_policy(tmp_path, capsys):
    """Saves every 2 steps with a full every 10 (5 checkpoints a cycle) up to step 120, then a
    full every 40 (20 a cycle) to step 280: the mix was averaged over the 12 cycles of 5 and
    the 4 of 20, (60 + 80) / 16 = 8.75, read as a full every 9, a mix the run never made.
    The run makes its fulls 40 steps apart now: a full every 20."""
    root = str(tmp_path)
    _saved_under(
        root,
        [
            (SavePolicy(full_every=10, incremental_every=2), range(120)),
            (SavePolicy(full_every=40, incremental_every=2), range(120, 281)),
        ],
    )
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 2
    assert advice.current_full_every == 20, advice.current_full_every
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN)
    (current,) = [line.split() for line in out.splitlines() if line.startswith("current")]
    assert code == 0 and current[4] == "20", out  # FULL EVERY, after the 3 words of TIME


def test_a_run_that_changed_its_interval_is_read_by_its_newest_policy(tmp_path):
    """Saves every 10 steps with a full every 50 up to step 500, then every 50 with a full
    every 250 to step 1500 (5 checkpoints a cycle throughout): the median gap over the
    history, 45 gaps of 10 against 20 of 50, read every 10 steps. It is every 50 now."""
    root = str(tmp_path)
    _saved_under(
        root,
        [
            (SavePolicy(full_every=50, incremental_every=10), range(500)),
            (SavePolicy(full_every=250, incremental_every=50), range(500, 1501)),
        ],
    )
    advice = advise(open_store(root), RUN)
    assert advice.current is not None
    assert advice.current.interval_steps == 50, advice.current.interval_steps
    assert advice.current_full_every == 5


@pytest.mark.parametrize(
    ("forced", "steps"),
    [(97, 106), (95, 102), (99, 102), (99, 104)],
    ids=["7 and 3", "5 and 5", "9 and 1", "9 and 1, then 100 and 102"],
)
def test_one_full_forced_by_hand_is_not_read_as_a_new_policy(tmp_path, forced, steps):
    """Saves every 2 steps with a full every 10 (5 checkpoints a cycle), and one full forced by
    hand at step 97 (``ckpt.save(97, state, kind="full")``): cut to its newest cycles made
    alike, the history read the lone cycle from 97 to 100 (97, 98: a full every 2); forced at
    95, the two halves it made of the cycle from 90 (3 each: a full every 3). Neither spans
    two of the run's cycles: too short to tell from one odd full, and the run makes 5 a cycle.
    Forced at 99, the cycle from 99 to 100 holds its full alone, as one retention thinned
    does, and cut the stretch: read as fulls alone every step (with 100 and 102 after it, the
    cycle under way: a full every 2). Shorter than the run's gaps, it could hold nothing more."""
    root = str(tmp_path)
    state = tiny_state()
    with Checkpointer(root, RUN, policy=SavePolicy(full_every=10, incremental_every=2)) as ckpt:
        for step in range(steps):
            tiny_train(state)
            ckpt.save(step, state, kind="full" if step == forced else None)
    fulls = [c.step for c in list_checkpoints(open_store(root), RUN) if c.kind == "full"]
    assert fulls == sorted([*range(0, steps, 10), forced])
    advice = advise(open_store(root), RUN)
    assert advice.current is not None and advice.current.interval_steps == 2
    assert advice.current_full_every == 5, advice.current_full_every
