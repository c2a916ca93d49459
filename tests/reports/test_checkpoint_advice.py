"""``advise``: the interval model's inputs read from a store, and ``ckptflow advise``."""

import json
import time

import pytest

from ckptflow import Checkpointer, SavePolicy, lifecycle, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.recovery_log import read_all
from ckptflow.errors import CkptflowError
from ckptflow.policy.interval import SCENARIOS
from ckptflow.reports.advice import DEFAULT_SCENARIO, MIN_FAILURES, advise
from ckptflow.reports.costs import CostModel
from support.cli import run_cli
from support.save_timing import chosen_save_timing
from support.states import RUN, tiny_state, tiny_train


def _train(root: str, steps: range, *, resume: bool = False) -> None:
    state = tiny_state()
    with Checkpointer(root, RUN, policy=SavePolicy(full_every=10, incremental_every=2)) as ckpt:
        if resume:
            ckpt.restore(state)
        for step in steps:
            tiny_train(state)
            time.sleep(0.002)
            ckpt.save(step, state)


def test_a_run_with_too_little_history_gets_the_preset_and_says_so(tmp_path):
    root = str(tmp_path)
    _train(root, range(0, 21))
    advice = advise(open_store(root), RUN)
    assert advice.inputs.mtbf_s == SCENARIOS[DEFAULT_SCENARIO][0]
    assert any("too little history" in n and DEFAULT_SCENARIO in n for n in advice.notes)
    assert any("no restore recorded" in n for n in advice.notes)
    assert advice.current is not None and advice.current.interval_steps == 2  # every second step saves
    assert advice.current_full_every == 5  # a full every 10 steps, a save every 2
    assert advice.optimal.interval_steps is not None and advice.optimal.interval_steps >= 1
    assert advice.optimal.total_usd_month <= advice.current.total_usd_month


def test_the_failure_rate_and_restore_time_are_measured_from_recoveries(tmp_path):
    root = str(tmp_path)
    _train(root, range(0, 5))
    for i in range(MIN_FAILURES):  # each resume is a recovery: the job restarted
        _train(root, range(5 + 5 * i, 10 + 5 * i), resume=True)
    store = open_store(root)
    advice = advise(store, RUN)
    records = read_all(store, RUN)
    manifests = [m for m in catalog.committed(store, RUN) if not isinstance(m, Exception)]
    span = max(max(m.committed_at for m in manifests), max(r["at"] for r in records)) - min(
        m.created_at for m in manifests
    )
    assert advice.sources["mtbf_s"].startswith(f"measured: {MIN_FAILURES} recoveries")
    assert advice.inputs.mtbf_s == pytest.approx(span / MIN_FAILURES)
    assert advice.sources["restore_s"] == f"median of {MIN_FAILURES} restores (recovery records)"
    assert not any("too little history" in n for n in advice.notes)
    # an explicit MTBF or a scenario overrides what was measured
    assert advise(store, RUN, mtbf_s=1234.0).inputs.mtbf_s == 1234.0
    assert advise(store, RUN, scenario="reliable").inputs.mtbf_s == SCENARIOS["reliable"][0]


def test_a_run_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(CkptflowError, match="no committed checkpoints.*save once"):
        advise(open_store(str(tmp_path)), "nothing")
    with pytest.raises(CkptflowError, match="unknown scenario 'spot'"):
        advise(open_store(str(tmp_path)), RUN, scenario="spot")


def test_the_cli_prints_current_and_optimal_with_the_fallbacks_taken(tmp_path, capsys):
    root = str(tmp_path / "store")
    _train(root, range(0, 11))
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--gpus", "8", "--gpu-hour-usd", "3")
    assert code == 0, err
    lines = out.splitlines()
    assert any(line.startswith("current") for line in lines) and any(line.startswith("optimal") for line in lines)
    assert "LOSS/FAILURE" in out and "RPO" in out and "TOTAL $/MO" in out
    assert "note: too little history" in out
    inputs = next(line for line in lines if line.startswith("  save (blocked)"))
    assert "0.0 s" not in inputs and inputs.count(" ms") >= 3, inputs  # millisecond saves and steps, said so
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--scenario", "preemptible", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["inputs"]["mtbf_s"] == SCENARIOS["preemptible"][0] and doc["inputs"]["gpus"] == 1
    assert doc["optimal"]["interval_steps"] >= 1 and doc["current"]["interval_steps"] == 2
    code, out, err = run_cli(capsys, "advise", root, "--run", "nope")
    assert code == 2 and "no run 'nope'" in err
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--mtbf", "6h", "--scenario", "reliable")
    assert code == 2 and "not allowed with argument" in err


@pytest.mark.parametrize(
    "args, prices, expect",
    [
        (["--mtbf", "inf"], None, "not a finite number"),
        (["--gpu-hour-usd", "inf"], None, "a finite non-negative number"),
        (["--gpu-hour-usd", "nan"], None, "a finite non-negative number"),
        ([], '{"prices": {"STANDARD": NaN}}', "finite non-negative numbers"),
    ],
)
def test_numbers_that_are_not_finite_are_one_clear_error(tmp_path, capsys, args, prices, expect):
    root = str(tmp_path / "store")
    _train(root, range(0, 5))
    if prices is not None:
        (tmp_path / "prices.json").write_text(prices)
        args = [*args, "--prices", str(tmp_path / "prices.json")]
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, *args)
    assert code == 2 and expect in err and "Traceback" not in err, (out, err)


def test_retention_expiring_old_checkpoints_does_not_shrink_the_measured_mtbf(tmp_path):
    """The span is the checkpoints held, the count was every recovery ever recorded: after
    retention expired the history before the last recovery, 3 recoveries were divided over
    the last segment alone (MTBF 0.32 s instead of 1.36 s in the reproducer). Only the
    recoveries since the oldest checkpoint held count; too few of them: the preset, said so."""
    root = str(tmp_path)
    _train(root, range(0, 10))
    for i in range(MIN_FAILURES):
        _train(root, range(10 + 10 * i, 20 + 10 * i), resume=True)
    store = open_store(root)
    records = read_all(store, RUN)
    for step in range(0, 30):
        lifecycle.expire(store, RUN, step)
    advice = advise(store, RUN)
    held = [m for m in catalog.committed(store, RUN) if not isinstance(m, Exception)]
    since = [r for r in records if r["at"] >= min(m.created_at for m in held)]
    assert len(since) < MIN_FAILURES  # the recoveries before the oldest checkpoint held are outside the span
    assert advice.inputs.mtbf_s == SCENARIOS[DEFAULT_SCENARIO][0]
    assert any(f"{len(since)} recoveries since the oldest checkpoint held" in n for n in advice.notes)


def test_an_mtbf_far_below_the_save_time_says_no_interval_finishes(tmp_path, capsys):
    """MTBF 1 us against saves of milliseconds: ``ckptflow advise`` died on an OverflowError
    from ``math.exp``; now the table says "never finishes" and a note says what to change."""
    root = str(tmp_path / "store")
    _train(root, range(0, 11))
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--mtbf", "0.000001")
    assert code == 0 and "Traceback" not in err, err
    assert "no checkpoint interval is expected to finish" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith(("current", "optimal"))]
    assert len(rows) == 2 and all("never finishes" in r and "never restored" in r for r in rows), out
    assert "nan" not in out.lower() and "inf" not in out.replace("info", "")
    note = next(line for line in out.splitlines() if line.startswith("note: no checkpoint interval finishes"))
    assert "MTBF of 1 µs" in note and "MTBFs" in note and "much shorter than the MTBF" in note
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--mtbf", "0.000001", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["optimal"]["finishes"] is False and doc["optimal"]["waste"] == 1.0
    assert doc["optimal"]["segment_s"] is None and doc["optimal"]["loss_per_failure_s"] is None  # inf -> null
    assert doc["notes"][0].startswith("no checkpoint interval finishes")
    advice = advise(open_store(root), RUN, mtbf_s=3600.0)  # an ordinary MTBF: no such note
    assert advice.optimal.finishes and not any("finishes" in n for n in advice.notes)


def test_the_advice_never_recommends_an_interval_that_costs_more_than_the_current_one(tmp_path, capsys, monkeypatch):
    """Saves every 2 and 3 steps in turn: the current interval is the median gap, 2.5 steps
    (said so: it read "every 2 steps" or "every 3" as float seconds divided back by the step
    time rounded), and the optimum a whole number of steps. Where the best interval lies between 2 and 3,
    both cost more than 2.5: with an MTBF of 6.3 ms ``ckptflow advise`` said "checkpoint
    every 2 steps" at $1423.48/month against the current $1423.26. The advice now keeps the
    current interval wherever no interval found costs less, and says so.

    The saves' and steps' times are chosen (8 ms, 3 ms, as an idle machine measures them):
    measured by the wall clock, a loaded machine's put that place (an MTBF about
    ``(2.5 steps)^2 / (2 saves)``) outside the sweep, or where no segment finishes."""
    root = str(tmp_path / "store")
    state = tiny_state()
    timing = chosen_save_timing(monkeypatch, save_s=0.008, step_s=0.003)
    with Checkpointer(root, RUN) as ck:
        for step in range(21):
            tiny_train(state)
            timing.train()
            if step % 5 in (0, 2):
                ck.save(step, state, kind="full")
    store = open_store(root)
    measured = advise(store, RUN).inputs
    assert (measured.save_s, measured.step_time_s) == pytest.approx((0.008, 0.003)), measured
    sweep = [advise(store, RUN, mtbf_s=10 ** (k / 40)) for k in range(-120, 41)]  # fine: the window is narrow
    assert all(a.current is not None and a.current.interval_s == 2.5 * a.inputs.step_time_s for a in sweep)
    assert all(a.current is not None and a.current.interval_steps == 2.5 for a in sweep)  # not 2 or 3
    finishing = [a for a in sweep if a.current is not None and a.current.finishes]
    dearer = [a for a in finishing if a.optimal.total_usd_month > a.current.total_usd_month]
    assert dearer, (  # the sweep crosses the optimum's place between 2 and 3 steps
        "no MTBF swept has its whole-step optimum dearer than the current 2.5 steps: optimum steps "
        f"{sorted({a.optimal.interval_steps for a in finishing})} over {len(finishing)} finishing MTBFs "
        f"of {len(sweep)} ({sweep[0].inputs.mtbf_s:g}-{sweep[-1].inputs.mtbf_s:g} s)"
    )
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--mtbf", str(dearer[0].inputs.mtbf_s))
    assert code == 0, err
    headline = out.splitlines()[0]
    assert headline.startswith(f"run {RUN}: keep checkpointing every 2.5 steps"), out
    assert "costs least" in headline
    (row,) = [line for line in out.splitlines() if line.startswith("current")]
    assert row.split()[1] == "2.5", out
    for a in finishing:
        assert a.recommended.total_usd_month <= a.current.total_usd_month
        assert a.keep_current == (a in dearer) == (a.recommended is a.current) == a.as_dict()["keep_current"]


def test_an_mtbf_of_a_googol_years_gives_lines_a_terminal_can_show(tmp_path, capsys):
    root = str(tmp_path)
    _train(root, range(0, 21))
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN, "--mtbf", "1e300s")
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) < 200, out


def test_a_run_without_a_step_time_is_advised_in_time_alone(tmp_path, capsys):
    """With one checkpoint there is no step time: the headline read "checkpoint every ?
    steps (56.0 s)"."""
    root = str(tmp_path)
    _train(root, range(0, 1))
    code, out, err = run_cli(capsys, "advise", root, "--run", RUN)
    headline = out.splitlines()[0]
    assert code == 0 and headline.startswith(f"run {RUN}: checkpoint every ") and "?" not in headline, out


def test_advice_without_prices_says_it_ranks_by_the_time_wasted(tmp_path):
    """With the GPU-hour and the storage free, every interval costs $0.00: the table alone
    cannot say why one was chosen."""
    root = str(tmp_path)
    _train(root, range(0, 21))
    free = CostModel.from_json(json.dumps({"prices": {"STANDARD": 0.0}}))
    advice = advise(open_store(root), RUN, gpu_hour_usd=0.0, costs=free)
    assert advice.optimal.total_usd_month == 0.0
    assert any("every price is zero" in n and "time they waste" in n for n in advice.notes), advice.notes
    assert not any("every price is zero" in n for n in advise(open_store(root), RUN).notes)


def test_json_gives_a_whole_interval_as_an_integer_in_both_fields_and_a_fractional_one_exactly(tmp_path, capsys):
    """Saves at steps 0, 2, 4, 6, 8: four gaps of 2, whose median is 2.0, and ``advise --json``
    wrote the current interval as ``2.0`` while the optimum's was an integer. A whole number of
    steps is a JSON integer in both fields; a median gap of 2.5 steps stays 2.5."""
    whole, fractional = str(tmp_path / "whole"), str(tmp_path / "fractional")
    _train(whole, range(0, 9))
    code, out, err = run_cli(capsys, "advise", whole, "--run", RUN, "--scenario", "preemptible", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["current"]["interval_steps"] == 2 and type(doc["current"]["interval_steps"]) is int
    assert type(doc["optimal"]["interval_steps"]) is int
    assert '"interval_steps": 2,' in out  # as written, not 2.0

    state = tiny_state()
    with Checkpointer(fractional, RUN) as ck:
        for step in range(21):
            tiny_train(state)
            time.sleep(0.002)
            if step % 5 in (0, 2):  # gaps of 2 and 3 in turn
                ck.save(step, state, kind="full")
    code, out, err = run_cli(capsys, "advise", fractional, "--run", RUN, "--scenario", "preemptible", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["current"]["interval_steps"] == 2.5 and type(doc["optimal"]["interval_steps"]) is int
