"""Is training recoverable right now? One answer per run, from what the store already records.

The operator's view (the ``recoverability`` asset in the Dagster layer, or any script):
per run, the newest recovery-ready checkpoint (committed and validated) with its step,
age and tiers; the RPO against its target; the last recovery and its RTO; and which
checkpoints need attention, counted "N of M" so that a few corrupt checkpoints read as
what they are, not as a broken pipeline. Bytes and $/month per tier come from
``ckptflow.reports.costs`` (the same figures as the cost report).

The decisions are pure functions over the inventory's entries
(``ckptflow.reports.inventory``), the recovery metrics (``ckptflow.reports.recoveries``) and
the recovery records, so they are tested without a store or Dagster; ``read_view`` does
the reading.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ckptflow.catalog.records import is_number
from ckptflow.catalog.verdicts import is_carried
from ckptflow.reports import costs, inventory, recoveries
from ckptflow.reports.units import human_bytes, human_duration, human_usd
from ckptflow.store.base import Store

_CHUNK_URL = re.compile(r"\S+/chunks/[0-9a-f]{2}/([0-9a-f]{12})[0-9a-f]*")
_CHUNK_DIGEST = re.compile(r"\bchunk ([0-9a-f]{12})[0-9a-f]*…?")


def short_problem(text: str, width: int = 120) -> str:
    """A problem on one short line: chunk URLs shortened to their digest's first 12 hex
    digits (the full text stays in the lifecycle record)."""
    line = _CHUNK_URL.sub(r"\1…", " ".join(str(text or "").split()))
    return line if len(line) <= width else line[: width - 1] + "…"


@dataclass(frozen=True)
class Reason:
    """Why a checkpoint failed its integrity check, in the words an operator searches for."""

    check: str  # which part of the integrity check: chunk hash, chunk missing, chunk size, rank record, manifest
    chunk: str  # the chunk's digest (first 12 hex digits), "" when no chunk is named
    text: str  # the problem on one short line

    def line(self) -> str:
        where = f"chunk {self.chunk}…: " if self.chunk and f"{self.chunk}…" not in self.text else ""
        return f"{self.check}: {where}{self.text}"


def reason_of(problem: str) -> Reason:
    """Classify one validation problem (``ckptflow.catalog.checkpoints.verify_checkpoint``'s
    wording, or the verdict an import carries: its source's, naming no chunk of this one)."""
    text = short_problem(problem)
    if is_carried(problem):
        return Reason(check="carried verdict", chunk="", text=text)
    found = _CHUNK_URL.search(problem) or _CHUNK_DIGEST.search(problem)
    chunk = found.group(1) if found else ""
    lowered = problem.lower()
    if "rank record" in lowered:
        check = "rank record"
    elif "manifest" in lowered and not chunk:
        check = "manifest"
    elif "missing" in lowered:
        check = "chunk missing"
    elif "does not match its address" in lowered or "checksum" in lowered:
        check = "chunk hash"
    elif chunk or lowered.startswith("chunk"):
        check = "chunk content"
    else:
        check = "integrity"
    return Reason(check=check, chunk=chunk, text=text)


def rpo_against_target(rpo_s: float | None, target_s: float) -> str:
    """The RPO with its target beside it: "2.7 s (target 1.0 h: met)"."""
    if rpo_s is None:
        return f"- (target {human_duration(target_s)}: no two recovery-ready checkpoints in the window)"
    verdict = "met" if rpo_s <= target_s else "MISSED"
    return f"{human_duration(rpo_s)} (target {human_duration(target_s)}: {verdict})"


def attention_reason(entry: inventory.Entry) -> str | None:
    """Why this checkpoint needs an operator, or None: it failed validation, its manifest
    could not be read, or a lifecycle step recorded a failure for this commit."""
    if entry.validation in ("failed", "unreadable"):
        problems = entry.manifest_error or "; ".join((entry.records.get("validation") or {}).get("problems", []))
        return reason_of(problems or "failed validation").line()
    failure = entry.records.get("failure")
    if failure and not made_good(failure, entry.records):
        return f"{failure.get('job') or 'a lifecycle run'} failed: {short_problem(failure.get('message', ''))}"
    return None


def made_good(failure: dict, records: dict[str, dict]) -> bool:
    """Whether later work made a recorded failure good: each record its work writes
    (``made_good_by``) is there, not failed, and written after the failure: another than
    the one that stood when the failure was recorded (``records_seen``), or, for one that
    stood then, written by a run begun after the failed one (``made_good_already``: the
    orchestrator's order). No two clocks are compared: a verdict and the failure are stamped
    by different machines, and a worker's clock running ahead made a verdict written before
    the failure look later (a failure shown as made good that no run redid), one running
    behind made every re-run's look earlier (a failure no re-run could clear). A failure
    recorded by an earlier ckptflow (no ``records_seen``) is judged by those clocks, as it
    was then. The failure record stays, as history."""
    kinds = failure.get("made_good_by")
    if not isinstance(kinds, list) or not kinds:
        return False
    done = {kind: records.get(kind) or {} for kind in kinds}
    if any(r.get("ok") is False or not is_number(r.get("recorded_at")) for r in done.values()):
        return False
    seen, already = failure.get("records_seen"), failure.get("made_good_already") or []
    if isinstance(seen, dict):
        return all(kind in already or done[kind]["recorded_at"] != seen.get(kind) for kind in kinds)
    failed_at = failure.get("recorded_at") if failure.get("failed_at") is None else failure.get("failed_at")
    return is_number(failed_at) and all(r["recorded_at"] > failed_at for r in done.values())


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    run: str
    checkpoints: int
    attention: list[tuple[int, str]]  # (step, reason) of the checkpoints that need attention
    ready_step: int | None  # the newest recovery-ready checkpoint
    ready_age_s: float | None
    ready_tiers: str
    rpo_s: float | None
    rpo_target_s: float
    last_recovery: dict | None  # the newest recovery record
    detection_s: float = 0.0
    blocked_step: int | None = None  # newer than the ready one, commit record unreadable: restore stops there

    @property
    def recoverable(self) -> bool:
        """A restore of the newest checkpoint would load a validated one now."""
        return self.ready_step is not None and self.blocked_step is None

    @property
    def rpo_met(self) -> bool | None:
        return None if self.rpo_s is None else self.rpo_s <= self.rpo_target_s

    @property
    def last_rto_s(self) -> float | None:
        """Detection time plus the last successful recovery's restore time."""
        r = self.last_recovery
        if not r or not r.get("ok") or not isinstance(r.get("duration_s"), (int, float)):
            return None
        return self.detection_s + float(r["duration_s"])

    def attention_line(self) -> str:
        return f"{len(self.attention)} of {self.checkpoints} need attention"

    def row(self, now: float) -> dict[str, str]:
        """The run's line in the operator's table, every figure in human units."""
        r = self.last_recovery
        if r is None:
            last = "none"
        else:
            what = f"step {r.get('step')}" if r.get("ok") else "FAILED"
            last = f"{what}, {human_duration(max(0.0, now - float(r.get('at', now))))} ago"
        return {
            "run": self.run,
            "recoverable": "yes"
            if self.recoverable
            else "NO" + (f": stops at step {self.blocked_step}" if self.blocked_step is not None else ""),
            "newest ready": "-" if self.ready_step is None else f"step {self.ready_step}",
            "age": human_duration(self.ready_age_s),
            "tier": self.ready_tiers or "-",
            "RPO (target)": rpo_against_target(self.rpo_s, self.rpo_target_s),
            "last recovery": last,
            "RTO": human_duration(self.last_rto_s),
            "attention": self.attention_line(),
        }


def run_statuses(
    entries: list[inventory.Entry],
    metrics: list[recoveries.RunMetrics],
    last_recoveries: dict[str, dict],
    *,
    now: float,
    rpo_target_s: float,
    detection_s: float = 0.0,
) -> list[RunStatus]:
    """One status per run that has checkpoints, metrics or recoveries (pure);
    ``last_recoveries``: each run's newest recovery record."""
    by_run: dict[str, list[inventory.Entry]] = {}
    for e in entries:
        by_run.setdefault(e.run, []).append(e)
    rpo = {m.run: m.rpo_s for m in metrics}
    out = []
    for run in sorted(set(by_run) | set(rpo) | set(last_recoveries)):
        found = by_run.get(run, [])
        ready = max((e for e in found if e.validation == "passed"), key=lambda e: e.step, default=None)
        # restore never falls back past a checkpoint it could not read (an outage, a newer format)
        blocked = max(
            (e.step for e in found if e.validation == "unreadable" and (ready is None or e.step > ready.step)),
            default=None,
        )
        attention = [(e.step, why) for e in found if (why := attention_reason(e)) is not None]
        out.append(
            RunStatus(
                run=run,
                checkpoints=len(found),
                attention=attention,
                ready_step=None if ready is None else ready.step,
                ready_age_s=None if ready is None else max(0.0, now - ready.created_at),
                ready_tiers="+".join(ready.tiers) if ready else "",
                rpo_s=rpo.get(run),
                rpo_target_s=rpo_target_s,
                last_recovery=last_recoveries.get(run),
                detection_s=detection_s,
                blocked_step=blocked,
            )
        )
    return out


def answer(statuses: list[RunStatus]) -> str:
    """The one line: can every run recover right now, and how much needs attention."""
    if not statuses:
        return "nothing to recover: no checkpoints yet"
    stuck = [s.run for s in statuses if s.ready_step is None]
    blocked = [
        f"{s.run} stops at step {s.blocked_step}" for s in statuses if s.ready_step is not None and not s.recoverable
    ]
    tail = f"; {attention_total(statuses)}"
    if stuck or blocked:
        why = ([f"{', '.join(stuck)} has no recovery-ready checkpoint"] if stuck else []) + (
            [f"a restore of {', '.join(blocked)}, whose commit record could not be read"] if blocked else []
        )
        return f"NO: {'; '.join(why)}{tail}"
    return f"yes: every run ({len(statuses)}) has a recovery-ready checkpoint{tail}"


def attention_counts(statuses: list[RunStatus]) -> tuple[int, int]:
    """(checkpoints needing attention, checkpoints) over every run."""
    return sum(len(s.attention) for s in statuses), sum(s.checkpoints for s in statuses)


def attention_total(statuses: list[RunStatus]) -> str:
    """ "2 of 9 checkpoints need attention" over every run."""
    return "{} of {} checkpoints need attention".format(*attention_counts(statuses))


def tier_rows(report: costs.CostReport) -> list[dict[str, str]]:
    """Bytes and $/month per tier, as the cost report prices them."""
    return [
        {
            "tier": t.tier,
            "storage class": t.storage_class,
            "checkpoints": str(t.checkpoints),
            "stored": human_bytes(t.stored_bytes),
            "cost": human_usd(t.monthly_usd, per="/month"),
        }
        for t in report.tiers
    ]


@dataclass(frozen=True, kw_only=True)
class OperatorView:
    now: float
    runs: list[RunStatus]
    cost: costs.CostReport

    @property
    def answer(self) -> str:
        return answer(self.runs)


def read_view(
    hot: Store,
    archive: Store | None = None,
    *,
    model: costs.CostModel | None = None,
    rpo_target_s: float,
    now: float | None = None,
    window_s: float = recoveries.DAY,
    detection_s: float = 0.0,
) -> OperatorView:
    """Read the store once per source (inventory, recovery metrics and records, costs) and decide."""
    now = time.time() if now is None else now
    entries = inventory.collect(hot, archive)
    metrics = recoveries.store_metrics(hot, now=now, window_s=window_s, detection_s=detection_s)
    last = {m.run: m.last_recovery for m in metrics if m.last_recovery is not None}  # read once, by the metrics
    statuses = run_statuses(entries, metrics, last, now=now, rpo_target_s=rpo_target_s, detection_s=detection_s)
    return OperatorView(now=now, runs=statuses, cost=costs.storage_costs(hot, archive, model=model))
