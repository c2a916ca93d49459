"""The checkpoint-interval model (``ckptflow.policy.interval``) against a simulation of failures."""

import math

import pytest

from ckptflow.policy import interval as model
from ckptflow.policy.interval_sim import simulate_waste

H, DAY = 3600.0, 86400.0


@pytest.mark.parametrize("save_s", [1.0, 60.0, 600.0])
@pytest.mark.parametrize("mtbf_s", [H, DAY, 7 * DAY])
@pytest.mark.parametrize("restore_s", [0.0, 600.0])
def test_expected_waste_agrees_with_a_simulation_of_exponential_failures(save_s, mtbf_s, restore_s):
    optimum = model.daly(save_s, mtbf_s)
    for interval in (optimum / 3, optimum, 3 * optimum):
        expected = model.waste(interval, save_s=save_s, mtbf_s=mtbf_s, restore_s=restore_s)
        simulated = simulate_waste(interval, save_s=save_s, mtbf_s=mtbf_s, restore_s=restore_s, seed=7)
        assert simulated == pytest.approx(expected, rel=0.05), (interval, expected, simulated)


def test_without_storage_the_optimum_is_dalys_and_near_youngs():
    inputs = model.IntervalInputs(save_s=30.0, save_duration_s=30.0, restore_s=120.0, mtbf_s=DAY)
    inputs = model.IntervalInputs(**{**inputs.__dict__, "storage_usd_per_gb_month": 0.0})
    best = model.optimum(inputs)
    assert best.interval_s == pytest.approx(model.daly(30.0, DAY), rel=0.01)
    assert best.interval_s == pytest.approx(model.young(30.0, DAY), rel=0.05)
    for other in (0.8 * best.interval_s, 1.25 * best.interval_s):  # a minimum, not just a formula
        assert model.evaluate(inputs, other).waste > best.waste
    # restore time scales the expected time, never the time-optimal interval
    slow = model.optimum(model.IntervalInputs(**{**inputs.__dict__, "restore_s": 1800.0}))
    assert slow.interval_s == pytest.approx(best.interval_s, rel=0.01) and slow.waste > best.waste


def test_storage_kept_by_retention_lengthens_the_optimal_interval():
    cheap = model.IntervalInputs(
        save_s=5.0, save_duration_s=20.0, restore_s=60.0, mtbf_s=DAY, full_bytes=50e9, storage_usd_per_gb_month=0.0
    )
    dear = model.IntervalInputs(**{**cheap.__dict__, "storage_usd_per_gb_month": 0.023})
    short, long = model.optimum(cheap), model.optimum(dear)
    assert long.interval_s > 1.5 * short.interval_s
    assert long.storage_usd_month < model.evaluate(dear, short.interval_s).storage_usd_month


def test_the_optimum_is_a_whole_number_of_steps_and_reports_rpo_and_loss():
    inputs = model.IntervalInputs(save_s=10.0, save_duration_s=40.0, restore_s=60.0, mtbf_s=4 * H, step_time_s=0.7)
    best = model.optimum(inputs)
    assert best.interval_steps is not None and best.interval_s == pytest.approx(best.interval_steps * 0.7)
    assert best.rpo_s == pytest.approx(best.interval_s + 40.0)  # the async part of a save adds to the RPO
    # lost per failure: about half a segment of rework plus the restore, for T << M
    assert best.loss_per_failure_s == pytest.approx((best.interval_s + 10.0) / 2 + 60.0, rel=0.05)


@pytest.mark.parametrize(
    ("incremental", "full", "every"),
    [(None, 100, 1), (100, 100, 1), (50, 100, 2), (10, 100, 10), (3, 100, 33), (1e-4, 100, model.MAX_FULL_EVERY)],
)
def test_a_full_every_k_checkpoints_from_the_incremental_to_full_size_ratio(incremental, full, every):
    assert model.full_every(full, incremental) == every


@pytest.mark.parametrize(("incremental", "full", "every"), [(2, 5, 3), (2, 7, 4), (2, 9, 5), (2, 93, 47), (6, 21, 4)])
def test_a_full_every_half_way_between_two_counts_goes_to_the_larger_every_time(incremental, full, every):
    """Python's round() is half-to-even: incrementals 0.4 of a full (2.5 checkpoints a full)
    gave a full every 2, at 0.222 (4.5) every 4, at 2/7 (3.5) every 4: ties went either way,
    and ``1 / (2 / 93)`` is 46.49999999999999, not the tie 46.5 it is. The model prices the
    longer mix lower, so a tie goes there; the K shown is the K the optimum was priced at."""
    assert model.full_every(full, incremental) == every
    sizes = {"full_bytes": full * 1e6, "incremental_bytes": incremental * 1e6}
    inputs = model.IntervalInputs(save_s=0.0, save_duration_s=0.0, restore_s=0.0, mtbf_s=DAY, **sizes)
    longer = model.with_mix(inputs, full_s=10.0, incremental_s=1.0, every=every)
    shorter = model.with_mix(inputs, full_s=10.0, incremental_s=1.0, every=every - 1)
    assert model.evaluate(longer, 600.0).total_usd_month < model.evaluate(shorter, 600.0).total_usd_month


def test_mixing_fulls_and_incrementals_averages_the_save_cost():
    base = model.IntervalInputs(save_s=0.0, save_duration_s=0.0, restore_s=0.0, mtbf_s=DAY)
    mixed = model.with_mix(base, full_s=10.0, incremental_s=1.0, every=10)
    assert (mixed.save_s, mixed.full_every) == (pytest.approx(1.9), 10)
    assert model.with_mix(base, full_s=10.0, incremental_s=None, every=10).save_s == 10.0


@pytest.mark.parametrize(
    "bad",
    [
        {"mtbf_s": 0.0},
        {"save_s": -1.0},
        {"step_time_s": 0.0},
        {"step_time_s": math.inf},  # every interval zero steps
        {"restore_s": math.nan},
        {"incremental_bytes": -1.0},  # negative storage bills
        {"recent_days": math.nan},
        {"full_days": -30.0},
    ],
)
def test_bad_inputs_are_refused_saying_which(bad):
    fields = {"save_s": 1.0, "save_duration_s": 1.0, "restore_s": 1.0, "mtbf_s": DAY, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        model.IntervalInputs(**fields)


@pytest.mark.parametrize(
    "extreme",
    [
        {"save_s": 3600.0, "restore_s": 60.0, "mtbf_s": 1.0},  # a save 3600 MTBFs long: exp(3600) overflowed
        {"save_s": 1.0, "restore_s": 3600.0, "mtbf_s": 1.0},  # a restore 3600 MTBFs long
        {"save_s": 200.0, "restore_s": 600.0, "mtbf_s": 1.0},  # finite, but 1e347 s per segment
        {"save_s": 30.0, "restore_s": 30.0, "mtbf_s": 1.0},  # in range: e^60 s per 1 s of work
    ],
)
def test_a_segment_that_never_finishes_is_reported_as_such_not_an_overflow(extreme):
    """A save or restore many MTBFs long made ``math.exp`` raise OverflowError in the search,
    or gave a loss per failure that was inf; the segment now never finishes, waste exactly 1."""
    inputs = model.IntervalInputs(save_duration_s=extreme["save_s"], step_time_s=0.5, **extreme)
    best = model.optimum(inputs)
    assert not best.finishes and best.waste == 1.0 and best.segment_s > 1e6 * best.interval_s
    assert best.interval_steps is not None and best.interval_steps >= 1
    assert not any(math.isnan(v) for v in (best.waste, best.loss_per_failure_s, best.total_usd_month))
    assert best.compute_usd_month == pytest.approx(inputs.gpus * inputs.gpu_hour_usd * model.HOURS_PER_MONTH)
    # the search still returns the interval closest to finishing: about an MTBF, as Daly's for C >= 2M
    assert best.interval_s == pytest.approx(extreme["mtbf_s"], rel=0.5)


def test_an_interval_far_past_the_mtbf_never_finishes_while_the_optimum_does():
    inputs = model.IntervalInputs(save_s=30.0, save_duration_s=30.0, restore_s=60.0, mtbf_s=H)
    best, never = model.optimum(inputs), model.evaluate(inputs, 1000 * H)  # expm1(1000) overflowed
    assert best.finishes and 0 < best.waste < 0.2 and math.isfinite(best.segment_s)
    assert not never.finishes and never.segment_s == math.inf and never.waste == 1.0
    assert never.loss_per_failure_s == pytest.approx(H + H * math.expm1(60 / H))  # a whole MTBF redone, one restore
    # where the closed form is in range the safe form is the same number
    assert best.segment_s == pytest.approx(H * math.exp(60 / H) * math.expm1((best.interval_s + 30) / H), rel=1e-12)


def test_with_every_price_zero_the_optimum_is_the_interval_that_wastes_least_time():
    """With GPU-hours and storage free every interval costs $0/month: the minimum over the
    grid was its first point, one step (a save every 0.7 s where Daly's optimum is 10 min).
    Equal costs are ranked by the time they waste, so the advice is still the time-optimal one."""
    free = model.IntervalInputs(
        save_s=10.0, save_duration_s=10.0, restore_s=60.0, mtbf_s=4 * H, step_time_s=0.7,
        gpu_hour_usd=0.0, storage_usd_per_gb_month=0.0, full_bytes=1e9,
    )  # fmt: skip
    best = model.optimum(free)
    assert best.total_usd_month == 0.0
    priced = model.optimum(model.IntervalInputs(**{**free.__dict__, "gpu_hour_usd": 2.0}))
    assert best.interval_steps == priced.interval_steps  # without storage, the price only scales the cost
    assert math.isclose(best.interval_s, model.daly(10.0, 4 * H), rel_tol=0.01)
