"""How often to checkpoint: the expected cost of an interval, and the interval that minimises it.

Pure: every input is an argument (``ckptflow.reports.advice`` reads them from a store).

The model (docs/checkpoint-interval.md). Failures arrive as a Poisson process with mean
time between failures ``M``; training does ``T`` seconds of work, then holds for a save
of ``C`` seconds (the blocked time), and so on; a failure loses the work since the last
completed save and costs a restore of ``R`` seconds, itself interrupted by failures (then
started again). Daly (2006) gives the expected wall time of one work-plus-save segment
exactly for that process:

    E(T) = M * exp(R / M) * (exp((T + C) / M) - 1)

so the fraction of wall time not spent on useful work (save stalls, lost work, restores)
is ``1 - T / E(T)``. To first order its minimum is Young's ``sqrt(2 * C * M)``; Daly's
higher-order form refines it. Restore time scales ``E`` by a constant, so it changes the
waste but not the time-optimal interval; storage does change it: a shorter interval means
more checkpoints kept by retention. ``optimum`` therefore minimises, over ``T``,

    USD/month = waste(T) * GPUs * USD/GPU-hour * 730 h  +  retained bytes(T) * USD/GB-month

where retained bytes follow ckptflow's default retention: every checkpoint younger than
``recent_days``, and fulls younger than ``full_days``. Fulls come every ``full_every``
checkpoints, chosen from the measured incremental/full size ratio (``full_every``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

HOUR = 3600.0
DAY = 86400.0
HOURS_PER_MONTH = 730.0
GB = float(1 << 30)

# Mean time between failures of the whole job, in seconds, for when a run has too little history
# to measure its own (``ckptflow.reports.advice``). Assumptions, not measurements: pass an MTBF to override.
SCENARIOS: dict[str, tuple[float, str]] = {
    "preemptible": (4 * HOUR, "spot / preemptible capacity, reclaimed a few times a day"),
    "unstable-network": (24 * HOUR, "multi-node job whose collectives time out about once a day"),
    "reliable": (7 * DAY, "dedicated hardware, a failure about once a week"),
}
MAX_FULL_EVERY = 1000
MIN_USEFUL = 1e-6  # below this useful fraction of wall time a segment counts as never finishing
_MAX_EXP = 700.0  # math.exp overflows a float past ~709.78


@dataclass(frozen=True, kw_only=True)
class IntervalInputs:
    """Everything the model needs, in seconds, bytes and USD."""

    save_s: float  # training held per checkpoint (blocked time), averaged over the full/incremental mix
    save_duration_s: float  # the whole save, to durable commit: adds to the RPO
    restore_s: float
    mtbf_s: float
    step_time_s: float | None = None  # None: intervals are given in seconds only
    full_bytes: float = 0.0  # bytes a full checkpoint writes
    incremental_bytes: float | None = None  # bytes an incremental writes (None: none measured)
    full_every: int = 1  # one full every this many checkpoints
    gpus: int = 1
    gpu_hour_usd: float = 2.0
    storage_usd_per_gb_month: float = 0.023
    recent_days: float = 7.0
    full_days: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "save_s",
            "save_duration_s",
            "restore_s",
            "full_bytes",
            "gpu_hour_usd",
            "storage_usd_per_gb_month",
            "recent_days",
            "full_days",
            "incremental_bytes",
        ):
            value = getattr(self, name)
            if value is None and name == "incremental_bytes":
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if not math.isfinite(self.mtbf_s) or self.mtbf_s <= 0:
            raise ValueError(f"mtbf_s must be a positive number of seconds, got {self.mtbf_s!r}")
        if self.step_time_s is not None and not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
            raise ValueError(f"step_time_s must be positive or None, got {self.step_time_s!r}")
        if self.full_every < 1 or self.gpus < 1:
            raise ValueError(f"full_every and gpus must be at least 1, got {self.full_every} and {self.gpus}")


@dataclass(frozen=True, kw_only=True)
class IntervalCost:
    """One interval, evaluated."""

    interval_s: float  # training time between checkpoints
    interval_steps: float | None  # the interval in steps, as given: an int where it is a whole number (the
    # optimum; a run's median gap of 2.0), 2.5 for a run saving every 2 and 3 steps in turn (``human_steps``
    # says it); None where the step time is not known
    save_overhead: float  # save stalls as a fraction of training time: C / T
    waste: float  # expected fraction of wall time lost: stalls, lost work, restores
    loss_per_failure_s: float  # expected work redone after a failure, plus the restore
    rpo_s: float  # worst-case training time lost by a failure just before a save commits
    compute_usd_month: float  # the waste priced in GPU-hours, per month of running
    storage_usd_month: float  # what retention keeps at this interval
    retained_checkpoints: float
    segment_s: float  # expected wall time of one interval plus its save, failures included (inf: never)

    @property
    def total_usd_month(self) -> float:
        return self.compute_usd_month + self.storage_usd_month

    @property
    def finishes(self) -> bool:
        """Whether a segment is expected to complete at all: False when less than ``MIN_USEFUL``
        of its expected wall time is training (a day of work would take thousands of years),
        its expected time past a float's range included."""
        return math.isfinite(self.segment_s) and self.interval_s >= MIN_USEFUL * self.segment_s


def segment_time(interval_s: float, *, save_s: float, mtbf_s: float, restore_s: float) -> float:
    """Daly's expected wall time to complete ``interval_s`` of work and its save: ``inf``
    where it is past what a float holds (a save or restore hundreds of MTBFs long), which
    ``IntervalCost.finishes`` reports as a segment that in expectation never completes."""
    m = mtbf_s
    if max(restore_s, interval_s + save_s) / m > _MAX_EXP:
        return math.inf
    return m * math.exp(restore_s / m) * math.expm1((interval_s + save_s) / m)  # inf past the float range


def log_segment_time(interval_s: float, *, save_s: float, mtbf_s: float, restore_s: float) -> float:
    """``log(segment_time)``, finite for every finite input: it orders intervals whose
    expected times are all past the float range."""
    m, x = mtbf_s, (interval_s + save_s) / mtbf_s
    log_expm1 = x + math.log1p(-math.exp(-x)) if x > 1.0 else math.log(math.expm1(x))
    return math.log(m) + restore_s / m + log_expm1


def waste(interval_s: float, *, save_s: float, mtbf_s: float, restore_s: float) -> float:
    """Expected fraction of wall time not spent on useful work (1.0: no progress expected)."""
    return 1.0 - interval_s / segment_time(interval_s, save_s=save_s, mtbf_s=mtbf_s, restore_s=restore_s)


def young(save_s: float, mtbf_s: float) -> float:
    """Young (1974): the first-order optimum ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    """Daly (2006): the higher-order optimum of ``waste`` (``M`` when a save costs 2M or more)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return young(save_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def full_every(full_bytes: float, incremental_bytes: float | None) -> int:
    """One full per this many checkpoints: once the incrementals since the last full have
    written as many bytes as a full, another full costs no more than the chain it ends (and
    resets how far deltas reach back). From the bytes themselves, not their ratio inverted:
    ``1 / (2 / 7)`` is 3.4999999999999996, ``7 / 2`` the tie 3.5 it is."""
    if incremental_bytes is None or full_bytes <= 0 or incremental_bytes >= full_bytes:
        return 1
    if incremental_bytes * MAX_FULL_EVERY <= full_bytes:
        return MAX_FULL_EVERY
    return whole_full_every(full_bytes / incremental_bytes)


def whole_full_every(checkpoints_per_full: float) -> int:
    """The whole number of checkpoints per full the model is evaluated at (``with_mix``),
    nearest ``checkpoints_per_full``, a tie to the larger (2.5 -> 3, 3.5 -> 4, never
    Python's half-to-even 2.5 -> 2, 3.5 -> 4): of two equally near, the model prices the
    longer mix lower (the mean save and the bytes kept fall as fulls get rarer, an
    incremental being the smaller save), so a tie goes there, the same way every time.
    Past ``MAX_FULL_EVERY`` it is that, compared before rounding: a whole number past any
    float (a decision's ``full_every`` of 10**400) overflows the sum."""
    if checkpoints_per_full >= MAX_FULL_EVERY:
        return MAX_FULL_EVERY
    return max(1, math.floor(checkpoints_per_full + 0.5))


def evaluate(inputs: IntervalInputs, interval_s: float) -> IntervalCost:
    """The expected costs of checkpointing every ``interval_s`` seconds of training."""
    if not interval_s > 0:
        raise ValueError(f"an interval must be a positive number of seconds, got {interval_s!r}")
    c, m, r = inputs.save_s, inputs.mtbf_s, inputs.restore_s
    segment = segment_time(interval_s, save_s=c, mtbf_s=m, restore_s=r)
    lost = 1.0 - interval_s / segment
    tau = interval_s + c
    if tau / m > _MAX_EXP:  # tau / expm1(tau / m) is below a float's resolution of m
        rework = m
    else:
        rework = m - tau / math.expm1(tau / m) if tau / m > 1e-9 else tau / 2
    restarts = m * math.expm1(r / m) if r / m <= _MAX_EXP else math.inf
    retained, nbytes = _retained(inputs, interval_s)
    steps = None if inputs.step_time_s is None else interval_s / inputs.step_time_s
    return IntervalCost(
        interval_s=interval_s,
        interval_steps=steps,
        save_overhead=c / interval_s,
        waste=lost,
        loss_per_failure_s=rework + restarts,
        rpo_s=interval_s + max(c, inputs.save_duration_s),
        compute_usd_month=lost * inputs.gpus * inputs.gpu_hour_usd * HOURS_PER_MONTH,
        storage_usd_month=nbytes / GB * inputs.storage_usd_per_gb_month,
        retained_checkpoints=retained,
        segment_s=segment,
    )


def evaluate_steps(inputs: IntervalInputs, steps: float) -> IntervalCost:
    """``evaluate`` for an interval of ``steps`` steps, which it reports exactly as given:
    2.5 steps in float seconds divided back by the step time can read 2.4999999999999996. A
    whole number of steps is an ``int`` whatever it came as: a median of the gaps 2 and 2 is
    2.0, which ``advise --json`` wrote as ``2.0`` beside the optimum's ``2``."""
    if inputs.step_time_s is None:
        raise ValueError("an interval in steps needs the step time (step_time_s)")
    exact = int(steps) if float(steps).is_integer() else steps
    return replace(evaluate(inputs, steps * inputs.step_time_s), interval_steps=exact)


def optimum(inputs: IntervalInputs) -> IntervalCost:
    """The interval with the lowest expected USD/month, a whole number of steps when the
    step time is known. Searched on a log grid around Daly's optimum, then refined."""
    shortest = inputs.step_time_s or 1e-3
    centre = max(daly(inputs.save_s, inputs.mtbf_s), shortest)
    grid = [centre * 10 ** (k / 50) for k in range(-200, 101)]
    best = min((t for t in grid if t >= shortest), key=lambda t: _rank(inputs, t))
    low, high = best / 10 ** (1 / 50), best * 10 ** (1 / 50)
    for _ in range(60):  # golden section on the bracketing grid cell
        a, b = high - (high - low) / 1.618034, low + (high - low) / 1.618034
        if _rank(inputs, a) < _rank(inputs, b):
            high = b
        else:
            low = a
    interval = max((low + high) / 2, shortest)
    step = inputs.step_time_s
    if step is not None:  # the nearer of the two whole-step intervals around it
        steps = max(1, math.floor(interval / step))
        return evaluate_steps(inputs, min((steps, steps + 1), key=lambda n: _rank(inputs, n * step)))
    return evaluate(inputs, interval)


def cheaper(cost: IntervalCost) -> tuple[float, float]:
    """How two intervals that finish compare: USD/month, then the time they waste, so that
    equal costs (every price zero) still rank the time-optimal interval first instead of
    whichever was looked at first."""
    return cost.total_usd_month, cost.waste


def _rank(inputs: IntervalInputs, interval_s: float) -> tuple[int, float, float]:
    """What ``optimum`` minimises: ``cheaper`` among intervals that finish; where none does
    (every cost is the whole GPU bill), the expected slowdown, in log form, so the answer is
    still the interval closest to finishing rather than an artefact of the float range."""
    cost = evaluate(inputs, interval_s)
    if cost.finishes:
        return 0, *cheaper(cost)
    c, m, r = inputs.save_s, inputs.mtbf_s, inputs.restore_s
    return 1, log_segment_time(interval_s, save_s=c, mtbf_s=m, restore_s=r) - math.log(interval_s), 0.0


def with_mix(inputs: IntervalInputs, *, full_s: float, incremental_s: float | None, every: int) -> IntervalInputs:
    """``inputs`` with the save cost averaged over one full per ``every`` checkpoints."""
    if incremental_s is None or every == 1:
        return replace(inputs, save_s=full_s, full_every=1)
    return replace(inputs, save_s=(full_s + (every - 1) * incremental_s) / every, full_every=every)


def _retained(inputs: IntervalInputs, interval_s: float) -> tuple[float, float]:
    """Checkpoints and bytes the default retention keeps in steady state: every one younger
    than ``recent_days``, fulls younger than ``full_days``; at least the newest."""
    wall = interval_s + inputs.save_s
    recent = max(1.0, inputs.recent_days * DAY / wall)
    older_fulls = max(0.0, (inputs.full_days - inputs.recent_days) * DAY / wall / inputs.full_every)
    incremental = inputs.full_bytes if inputs.incremental_bytes is None else inputs.incremental_bytes
    mean = (inputs.full_bytes + (inputs.full_every - 1) * incremental) / inputs.full_every
    return recent + older_fulls, recent * mean + older_fulls * inputs.full_bytes
