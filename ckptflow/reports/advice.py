"""The checkpoint-interval advice for one run: the model's inputs read from the store.

``ckptflow.policy.interval`` is the model; this module measures its inputs, so the user is
asked for prices only: the save cost and step time from the ``save_cost`` record every commit
carries (the step time from the newest saves: the pace now), bytes per kind from the manifests'
stats, the restore time and the failure rate from the run's recovery records
(``ckptflow.catalog.recovery_log``), and the storage price from the cost model
(``ckptflow.reports.costs``). Where a run has too little history the advice falls back (a
scenario preset, a save's duration standing in for a restore) and says so in ``notes``, and
``sources`` names where each input came from.

A recovery record that loaded a checkpoint counts as a failure: the job restarted. A
planned restart counts too, which errs toward checkpointing more often.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog.recovery_log import read_all
from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.policy import interval as model
from ckptflow.reports.costs import CostModel
from ckptflow.reports.units import human_duration, human_period, human_steps
from ckptflow.store.base import Store

MIN_FAILURES = 3  # fewer recoveries than this: the measured failure rate is noise, use a preset
DEFAULT_SCENARIO = "unstable-network"
RECENT_STEP_TIMES = 3  # the step time now: the newest measurements' median (outvotes one odd step)


@dataclass(frozen=True, kw_only=True)
class Advice:
    run: str
    inputs: model.IntervalInputs  # as used for the optimum (save cost averaged over its full/incremental mix)
    optimal: model.IntervalCost
    current: model.IntervalCost | None  # the run's interval now (``_current``); None with one commit
    young_s: float  # Young's first-order optimum sqrt(2 C M), for reference
    full_every: int  # one full per this many checkpoints, from the measured size ratio
    current_full_every: int | None
    sources: dict[str, str] = field(default_factory=dict)  # input -> where it came from
    notes: list[str] = field(default_factory=list)  # fallbacks taken, and why

    @property
    def keep_current(self) -> bool:
        """Whether the current interval costs no more than the optimum found (``cheaper``:
        at equal cost, wastes no more time), which then is no advice to change: the current
        interval is the run's own (``_current``: its newest save's decision, or the median of
        the gaps between its commits, 2.5 steps between the optimum's whole steps) and runs its
        own full/incremental mix, so it can cost less."""
        return (
            self.current is not None
            and self.current.finishes
            and model.cheaper(self.current) <= model.cheaper(self.optimal)
        )

    @property
    def recommended(self) -> model.IntervalCost:
        """The interval to checkpoint at: the current one where it costs least, else the optimum."""
        return self.current if self.keep_current and self.current is not None else self.optimal

    def as_dict(self) -> dict[str, Any]:
        def cost(c: model.IntervalCost | None) -> dict | None:
            return None if c is None else {**asdict(c), "total_usd_month": c.total_usd_month, "finishes": c.finishes}

        return {
            "run": self.run,
            "inputs": asdict(self.inputs),
            "optimal": cost(self.optimal),
            "current": cost(self.current),
            "young_s": self.young_s,
            "full_every": self.full_every,
            "current_full_every": self.current_full_every,
            "sources": dict(self.sources),
            "notes": list(self.notes),
            "keep_current": self.keep_current,
        }


def advise(
    store: Store,
    run: str,
    *,
    mtbf_s: float | None = None,
    scenario: str | None = None,
    gpus: int = 1,
    gpu_hour_usd: float = 2.0,
    costs: CostModel | None = None,
    recent_days: float = 7.0,
    full_days: float = 30.0,
) -> Advice:
    """The interval that minimises expected USD/month for ``run``, next to its current one.

    The failure rate: ``mtbf_s`` if given, else ``scenario``'s preset if given, else measured
    from the run's recoveries when it has at least ``MIN_FAILURES``, else the
    ``DEFAULT_SCENARIO`` preset (with a note saying so)."""
    check_failure_rate(mtbf_s=mtbf_s, scenario=scenario)
    manifests = [m for m in catalog.committed(store, run) if isinstance(m, Manifest)]
    measured = [m for m in manifests if m.save_cost is not None]
    if not measured:
        what = "no committed checkpoints" if not manifests else "no checkpoint recording its save cost"
        raise CkptflowError(
            f"run {run!r} in {store.url} has {what}: the advice needs at least one save by this "
            "version of ckptflow (each commit records what it cost); save once, then ask again"
        )
    notes: list[str] = []
    sources: dict[str, str] = {}
    fulls = [m for m in measured if m.kind == "full"]
    incs = [m for m in measured if m.kind == "incremental"]
    full_s = _median([m.save_cost.blocked_s for m in fulls if m.save_cost]) if fulls else None
    inc_s = _median([m.save_cost.blocked_s for m in incs if m.save_cost]) if incs else None
    full_bytes = _median([m.stats.added_bytes for m in manifests if m.kind == "full"])
    inc_bytes = _median([m.stats.added_bytes for m in manifests if m.kind == "incremental"]) if incs else None
    if full_s is None:  # only incrementals measured: their cost stands in for a full's
        full_s = inc_s or 0.0
        notes.append("no full checkpoint records its save cost: an incremental's stands in for a full's")
    every = model.full_every(full_bytes, inc_bytes)
    if inc_bytes is None:
        notes.append("no incremental checkpoints yet: the split between full and incremental is not measured")
    sources["save_s"] = f"median blocked time of {len(fulls)} full / {len(incs)} incremental saves (manifests)"
    step_time, sources["step_time_s"] = _step_time(measured)
    if step_time is None:
        notes.append("no step time measured yet (needs two saves, or a restore then a save): intervals in time only")
    recoveries = [r for r in read_all(store, run) if r.get("ok") and r.get("step") is not None]
    restores = [float(r["duration_s"]) for r in recoveries if isinstance(r.get("duration_s"), (int, float))]
    if restores:
        restore_s = _median(restores)
        sources["restore_s"] = f"median of {len(restores)} restores (recovery records)"
    else:
        restore_s = _median([m.save_cost.duration_s for m in measured if m.save_cost])
        sources["restore_s"] = "no restore recorded: the median save duration stands in"
        notes.append(sources["restore_s"])
    mtbf, sources["mtbf_s"] = _mtbf(manifests, recoveries, mtbf_s, scenario, notes)
    price = (costs or CostModel()).monthly("hot", model.GB)
    sources["storage_usd_per_gb_month"] = "the cost model's hot tier price"
    if price == 0 and gpu_hour_usd == 0:
        notes.append("every price is zero (GPU-hour, storage): intervals are ranked by the time they waste")
    base = model.IntervalInputs(
        save_s=full_s,
        save_duration_s=_median([m.save_cost.duration_s for m in measured if m.save_cost]),
        restore_s=restore_s,
        mtbf_s=mtbf,
        step_time_s=step_time,
        full_bytes=full_bytes,
        incremental_bytes=inc_bytes,
        gpus=gpus,
        gpu_hour_usd=gpu_hour_usd,
        storage_usd_per_gb_month=price,
        recent_days=recent_days,
        full_days=full_days,
    )
    inputs = model.with_mix(base, full_s=full_s, incremental_s=inc_s, every=every)
    current, current_every = _current(manifests, base, full_s, inc_s, step_time, notes, sources)
    optimal = model.optimum(inputs)
    notes[:0] = _never_finishes(inputs, optimal, current)  # first: it outweighs every fallback
    return Advice(
        run=run,
        inputs=inputs,
        optimal=optimal,
        current=current,
        young_s=model.young(inputs.save_s, mtbf),
        full_every=every,
        current_full_every=current_every,
        sources=sources,
        notes=notes,
    )


def check_failure_rate(*, mtbf_s: float | None, scenario: str | None) -> None:
    """Refuses a failure rate ``advise`` cannot use, whatever the run: callers that advise many
    runs check once, so a bad setting is not taken for one run's too-short history."""
    if scenario is not None and scenario not in model.SCENARIOS:
        raise CkptflowError(f"unknown scenario {scenario!r}: choose one of {sorted(model.SCENARIOS)} or give an MTBF")
    if mtbf_s is not None and not 0 < mtbf_s < math.inf:
        raise CkptflowError(f"an MTBF must be a positive duration, got {mtbf_s!r} seconds")


def _step_time(measured: list[Manifest]) -> tuple[float | None, str]:
    """The pace now, as the current interval is read from the newest saves: the whole history's
    median lags a run whose steps slowed (1 s, then 3 s) while the older pace outnumbers the newer."""
    by_commit = sorted(measured, key=lambda m: m.committed_at)
    times = [m.save_cost.step_time_s for m in by_commit if m.save_cost and m.save_cost.step_time_s]
    recent = times[-RECENT_STEP_TIMES:]
    return (_median(recent) if recent else None), f"median of the newest {len(recent)} of {len(times)} (manifests)"


def _mtbf(
    manifests: list[Manifest], recoveries: list[dict], mtbf_s: float | None, scenario: str | None, notes: list[str]
) -> tuple[float, str]:
    if mtbf_s is not None:
        return mtbf_s, "given"
    if scenario is not None:
        return model.SCENARIOS[scenario][0], f"preset {scenario!r}: {model.SCENARIOS[scenario][1]}"
    # the history is what the store still holds: retention expires old checkpoints but never the
    # recovery records, so only the recoveries since the oldest checkpoint held fall in that span
    start = min(m.created_at for m in manifests)
    within = [r for r in recoveries if float(r.get("at", 0)) >= start]
    if len(within) >= MIN_FAILURES:
        end = max([m.committed_at for m in manifests] + [float(r.get("at", 0)) for r in within])
        if end > start:
            return (end - start) / len(within), f"measured: {len(within)} recoveries over the run's history"
    preset = model.SCENARIOS[DEFAULT_SCENARIO]
    notes.append(
        f"too little history to measure the failure rate ({len(within)} recoveries since the oldest checkpoint "
        f"held, {MIN_FAILURES} needed): using the {DEFAULT_SCENARIO!r} preset (MTBF {human_period(preset[0])}); "
        "give an MTBF or a scenario to override"
    )
    return preset[0], f"preset {DEFAULT_SCENARIO!r} (too little history): {preset[1]}"


def _never_finishes(
    inputs: model.IntervalInputs, optimal: model.IntervalCost, current: model.IntervalCost | None
) -> list[str]:
    """What a segment that in expectation never completes means, and what to change."""
    if not optimal.finishes:
        c, r, m = inputs.save_s, inputs.restore_s, inputs.mtbf_s
        return [
            f"no checkpoint interval finishes: with saves holding training {human_duration(c)} and restores "
            f"taking {human_duration(r)} against an MTBF of {human_duration(m)} (a save lasts {c / m:.3g} MTBFs, "
            f"a restore {r / m:.3g}), a failure is expected before a save or a restore completes, so the job is "
            "expected never to get past its next checkpoint (waste 100%; the optimal row is only the interval "
            "closest to finishing). Make saves and restores much shorter than the MTBF (incremental or "
            "non-blocking saves, a faster store) or failures rarer; check the MTBF given or measured"
        ]
    if current is not None and not current.finishes:
        return [
            f"the current interval ({human_duration(current.interval_s)} of training between checkpoints) never "
            f"finishes in expectation: a failure is expected long before that much work and its save complete "
            f"(MTBF {human_duration(inputs.mtbf_s)}), so the job keeps redoing it (waste 100%); checkpoint every "
            f"{human_steps(optimal.interval_steps, unknown='?')} steps ({human_duration(optimal.interval_s)}) instead"
        ]
    return []


def _current(
    manifests: list[Manifest],
    base: model.IntervalInputs,
    full_s: float,
    inc_s: float | None,
    step_time: float | None,
    notes: list[str],
    sources: dict[str, str],
) -> tuple[model.IntervalCost | None, int | None]:
    """The run's interval now and its full/incremental mix. Saved last by
    ``SavePolicy.adaptive``: what that save's decision records (``_decided``), since the
    policy moves its interval and the gaps of any stretch of history lag behind it (every
    100 steps then every 500, a full every 10 saves: read as every 100 for 8 saves of 500).
    Else the median step gap between commits (2.5 steps, said so) over the history as the
    run made it, and its checkpoints per full over its whole full cycles (fulls every 9
    steps, saves every 2: 5 a cycle, where the gaps' ratio 4.5 is neither); both from ``_as_made``."""
    decided = _decided(max(manifests, key=lambda m: m.committed_at))
    interval: float
    if decided is not None and step_time is not None:
        interval, every = decided
        sources["current"] = "the newest save's decision (save_decision): the adaptive policy's interval then"
    else:
        steps = sorted(m.step for m in manifests)
        start, per_full = _as_made(sorted(set(steps)), sorted({m.step for m in manifests if m.kind == "full"}))
        recent = [s for s in steps if s >= start]
        gaps = [b - a for a, b in zip(recent, recent[1:]) if b > a]
        if not gaps or step_time is None:
            notes.append("the current interval is not known yet (needs two commits and a measured step time)")
            return None, None
        interval = _median(gaps)
        every = model.whole_full_every(per_full) if per_full else model.MAX_FULL_EVERY
        sources["current"] = f"the median of the gaps between the newest {len(recent)} commits, made alike (manifests)"
    inputs = model.with_mix(base, full_s=full_s, incremental_s=inc_s, every=every)
    return model.evaluate_steps(inputs, interval), every


def _decided(manifest: Manifest) -> tuple[int, int] | None:
    """The interval in force and the saves per full that ``AdaptivePolicy`` recorded saving
    ``manifest`` (``save_decision``), or None: another policy saved it, or the record is not
    of the shape ckptflow writes (whole steps and saves, at least 1; no interval past the
    last step a run can have: 10**400 steps, which JSON holds, is no float)."""
    decision = manifest.extra.get("save_decision")
    if not isinstance(decision, dict):
        return None
    every, per_full = decision.get("every_steps"), decision.get("full_every")
    if type(every) is int and type(per_full) is int and 1 <= every < 10**fmt.STEP_DIGITS and per_full >= 1:
        return every, model.whole_full_every(per_full)
    return None


def _as_made(steps: list[int], full_steps: list[int]) -> tuple[int, float | None]:
    """Where the history as the run made it starts, and its checkpoints per full (None
    without a full). Retention keeps fulls longer than incrementals (30 days against 7 by
    default), so the older cycles hold their full alone: their gaps (a whole cycle each)
    would outnumber the run's own once the thinned part is the longer (saves every step, a
    full every 2: read as every 2 steps), and a cycle kept past that by one checkpoint
    (best-K, a pin) is not the run's mix either. So: the newest unbroken stretch of whole
    cycles between ``full_steps`` that hold more than their full (or could not:
    ``_could_hold_no_more``). After a thinned cycle,
    retention's cut-off by age may fall inside the oldest of them (its older incrementals
    gone: a full every 4 read for every 5), with a checkpoint kept as the best before it: the
    oldest is left out, and the next while it holds fewer than the one after it; the one
    left alone is read as the cycle under way is (``_cycle``). Else the cycle under way, if
    it holds more than its full (a cycle longer than the week retention keeps leaves no
    whole one). Else the run saves fulls alone now (a policy changed to fulls only, a
    history thinned whole): from the newest unbroken stretch of cycles holding their full
    alone. Either stretch is then cut to its newest cycles that agree (``_agreeing``): a run
    restarted under another policy made the older ones."""
    if not full_steps:
        return (steps[0] if steps else 0), None
    cycles = [bisect_left(steps, end) - bisect_left(steps, start) for start, end in zip(full_steps, full_steps[1:])]
    first = len(cycles)
    while first > 0 and (cycles[first - 1] > 1 or _could_hold_no_more(steps, full_steps, first - 1)):
        first -= 1
    if 0 < first < len(cycles):  # after a thinned cycle
        first = min(first + 1, len(cycles) - 1)
        while first < len(cycles) - 1 and cycles[first] < cycles[first + 1]:
            first += 1
        if first == len(cycles) - 1:
            return full_steps[first], _cycle(steps, full_steps, first)
    if first < len(cycles):
        first = _agreeing(steps, full_steps, first)
        made = cycles[first:]
        return full_steps[first], sum(made) / len(made)
    if len(steps) - bisect_left(steps, full_steps[-1]) > 1:
        return full_steps[-1], _cycle(steps, full_steps, len(full_steps) - 1)
    if not cycles:
        return steps[0], len(steps) / len(full_steps)
    while first > 0 and cycles[first - 1] == 1:
        first -= 1
    return full_steps[_agreeing(steps, full_steps, first)], 1.0


def _could_hold_no_more(steps: list[int], full_steps: list[int], i: int) -> bool:
    """Whether cycle ``i``, holding its full alone, is shorter than the longest gap of the
    cycle before it: one full forced by hand a step before the next (99 of a run with a full
    every 10 steps and saves every 2) leaves no step the run would have saved in between,
    so retention thinned nothing there."""
    if i == 0:
        return False
    held = steps[bisect_left(steps, full_steps[i - 1]) : bisect_left(steps, full_steps[i]) + 1]
    return full_steps[i + 1] - full_steps[i] < max(b - a for a, b in zip(held, held[1:]))


def _agreeing(steps: list[int], full_steps: list[int], first: int) -> int:
    """Where the newest stretch of whole cycles (from ``first`` on) made alike starts. A cycle
    is made as its fulls' distance and its longest gap say (the policy's save interval; the
    gaps next to a full may be shorter), not its count (a full every 5 steps and a save every
    3 hold 2 and 3 in turn, one policy); alike: over the stretch, neither varies by a factor
    of 2 or more (saves every 2 and 3 steps in turn are one policy; every 10 then every 20 are
    two). A run restarted under another policy, 5 checkpoints a full then 20, or saves every
    10 steps then every 50, read an average of both (a full every 9, every 10 steps). One full
    forced by hand cuts a cycle in two: a stretch of one cycle, or of two spanning less than
    two of the cycle before them, is too short to tell from that (forced at 97 of a run with a
    full every 10 steps and saves every 2: cycles of 7 and 3 steps, the last alone read a full
    every 2; forced at 95: two of 5 steps, a full every 3), and is read with the stretch before it."""

    def made(i: int) -> tuple[int, int]:
        held = steps[bisect_left(steps, full_steps[i]) : bisect_left(steps, full_steps[i + 1]) + 1]
        return full_steps[i + 1] - full_steps[i], max(b - a for a, b in zip(held, held[1:]))

    def alike_to(newest: int) -> int:
        low: tuple[int, ...] = made(newest)
        high = low
        while newest > first:
            older = made(newest - 1)
            low, high = tuple(map(min, low, older)), tuple(map(max, high, older))
            if any(h >= 2 * lo for lo, h in zip(low, high)):
                break
            newest -= 1
        return newest

    def too_short(start: int) -> bool:
        held = len(full_steps) - 1 - start
        return held < 2 or (
            held == 2 and full_steps[-1] - full_steps[start] < 2 * (full_steps[start] - full_steps[start - 1])
        )

    start = alike_to(len(full_steps) - 2)
    while start > first and too_short(start):
        start = alike_to(start - 1)
    return start


def _cycle(steps: list[int], full_steps: list[int], i: int) -> float:
    """The checkpoints per full of the cycle from ``full_steps[i]`` on, which holds more than
    its full but maybe only part of what the run made (cut by retention's age cut-off, or
    under way): its checkpoints held, or the fulls' distance (its own, else the last two's)
    in the median gap from its full on, whichever is more."""
    held = steps[bisect_left(steps, full_steps[i]) :]
    count = bisect_left(held, full_steps[i + 1]) if i + 1 < len(full_steps) else len(held)
    if len(full_steps) < 2:
        return count
    start, end = full_steps[i : i + 2] if i + 1 < len(full_steps) else full_steps[-2:]
    return max(count, (end - start) / _median([b - a for a, b in zip(held, held[1:])]))


def _median(values: list[float] | list[int]) -> float:
    return float(statistics.median(values)) if values else 0.0
