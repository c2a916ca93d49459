"""``ckptflow.reports.recoverable``: the operator's answer to "is training recoverable right
now?", decided from inventory entries, recovery metrics and recovery records (no store,
no Dagster)."""

from ckptflow.catalog.verdicts import carried_failure
from ckptflow.reports import costs, recoverable
from ckptflow.reports.inventory import Entry
from ckptflow.reports.recoveries import RunMetrics

NOW = 1_000_000.0
HOUR = 3600.0
CHUNK = "file:///tmp/store/chunks/ab/abcdef0123456789abcdef0123456789"


def entry(run, step, *, ok=None, created=NOW - HOUR, tiers=("hot",), problems=(), failure=None) -> Entry:
    e = Entry(run, step, kind="full", created_at=created, tiers=list(tiers), digest=f"d{step}")
    if ok is not None:
        e.records["validation"] = {"ok": ok, "problems": list(problems)}
    if failure is not None:
        e.records["failure"] = failure
    return e


def metrics(run, rpo_s) -> RunMetrics:
    return RunMetrics(
        run=run, checkpoints=0, save_interval_s=None, ready_s=None, recoveries=0, recoveries_ok=0,
        fallbacks=0, restore_s=None, rpo_s=rpo_s,
    )  # fmt: skip


def test_a_corrupt_chunk_reads_as_which_chunk_and_which_check():
    reason = recoverable.reason_of(f"chunk {CHUNK} does not match its address (neither the sha256 nor …)")
    assert (reason.check, reason.chunk) == ("chunk hash", "abcdef012345")
    assert reason.line() == "chunk hash: chunk abcdef012345… does not match its address (neither the sha256 nor …)"
    assert CHUNK not in reason.line() and "\n" not in reason.line()
    missing = recoverable.reason_of(f"chunk abcdef0123456789… is missing from {CHUNK}")
    assert (missing.check, missing.chunk) == ("chunk missing", "abcdef012345")
    rank = recoverable.reason_of("rank record file:///s/run/step/ranks/1.json is missing")
    assert (rank.check, rank.chunk) == ("rank record", "")


def test_a_verdict_an_import_carries_reads_as_carried_not_as_a_damaged_chunk():
    """An import made with allow_failed fails validation by its source's verdict, whose
    problem names the source store's chunk: the integrity check's reason and the "needs
    attention" line said "chunk hash: chunk abcdef012345…", pointing at a chunk this
    checkpoint does not have. Damage found in its own bytes is still said as such first."""
    source = {"recorded_at": NOW, "problems": [f"chunk {CHUNK} does not match its address"]}
    carried = carried_failure({"import": {"source": "/exports/m", "failed_validation": source}})
    assert carried is not None
    reason = recoverable.reason_of(carried)
    assert (reason.check, reason.chunk) == ("carried verdict", "")
    assert reason.line().startswith("carried verdict: imported from /exports/m, exported despite a failed validation")
    rotten = f"chunk {CHUNK.replace('abcdef', 'fedcba')} does not match its address"
    e = entry("a", 30, ok=False, problems=[rotten, carried])
    assert recoverable.attention_reason(e).startswith("chunk hash: chunk fedcba012345…")


def test_per_run_newest_ready_checkpoint_attention_and_last_recovery():
    entries = [
        entry("a", 10, ok=True, created=NOW - 3 * HOUR, tiers=("hot", "archive")),
        entry("a", 20, ok=True, created=NOW - 2 * HOUR),
        entry("a", 30, ok=False, created=NOW - HOUR, problems=[f"chunk {CHUNK} does not match its address"]),
        entry("a", 40, created=NOW - 60),  # not validated yet: neither ready nor needing attention
        entry("b", 5, ok=False, problems=["rank record x is missing"]),
    ]
    records = {"a": {"at": NOW - 600, "ok": True, "step": 20, "duration_s": 2.0}}  # the newest
    a, b = recoverable.run_statuses(
        entries, [metrics("a", 1.5 * HOUR)], records, now=NOW, rpo_target_s=HOUR, detection_s=30.0
    )
    assert (a.ready_step, a.ready_age_s, a.ready_tiers) == (20, 2 * HOUR, "hot")  # the newest passed, not 30 nor 40
    assert a.attention == [(30, "chunk hash: chunk abcdef012345… does not match its address")]
    assert a.attention_line() == "1 of 4 need attention" and a.rpo_met is False
    assert a.last_recovery["step"] == 20 and a.last_rto_s == 32.0  # detection + the last restore
    row = a.row(NOW)
    assert row["RPO (target)"] == "90.0 min (target 60.0 min: MISSED)" and row["recoverable"] == "yes"
    assert row["last recovery"] == "step 20, 10.0 min ago" and row["RTO"] == "32.0 s" and row["tier"] == "hot"
    assert not b.recoverable and b.row(NOW)["newest ready"] == "-" and b.attention_line() == "1 of 1 need attention"
    assert recoverable.answer([a, b]) == "NO: b has no recovery-ready checkpoint; 2 of 5 checkpoints need attention"
    assert (
        recoverable.answer([a])
        == "yes: every run (1) has a recovery-ready checkpoint; 1 of 4 checkpoints need attention"
    )
    assert recoverable.attention_total([a, b]) == "2 of 5 checkpoints need attention"


def test_a_failed_recovery_has_no_rto_and_a_recorded_lifecycle_failure_needs_attention():
    entries = [entry("a", 10, ok=True, failure={"job": "__ASSET_JOB", "message": "evaluation: evaluator raised"})]
    [a] = recoverable.run_statuses(
        entries, [], {"a": {"at": NOW - 60, "ok": False, "step": None}}, now=NOW, rpo_target_s=HOUR
    )
    assert a.last_rto_s is None and a.row(NOW)["last recovery"] == "FAILED, 60.0 s ago"
    assert a.attention == [(10, "__ASSET_JOB failed: evaluation: evaluator raised")]
    assert a.row(NOW)["RPO (target)"].startswith("- (target 60.0 min: no two recovery-ready")


def test_tier_rows_are_the_cost_reports_figures_as_money():
    hot = costs.TierCost(
        tier="hot", storage_class="STANDARD", price=0.023, stored_bytes=5 << 20, monthly_usd=0.000112, checkpoints=4
    )
    archive = costs.TierCost(
        tier="archive",
        storage_class="GLACIER_IR",
        price=0.004,
        stored_bytes=6 << 10,
        monthly_usd=2.25e-05,
        checkpoints=2,
    )
    report = costs.CostReport(
        tiers=[hot, archive], baseline_bytes=0, baseline_usd=0.0, savings_usd={}, savings_bytes={}
    )
    hot, archive = recoverable.tier_rows(report)
    assert hot == {
        "tier": "hot",
        "storage class": "STANDARD",
        "checkpoints": "4",
        "stored": "5.0 MiB",
        "cost": "$0.000112/month",
    }
    assert archive["cost"] == "$0.0000225/month" and archive["stored"] == "6.0 KiB"


def test_nothing_committed_yet_is_said_as_such():
    assert recoverable.answer([]) == "nothing to recover: no checkpoints yet"


def test_a_newer_checkpoint_that_could_not_be_read_blocks_recovery_until_it_can_be():
    """Restore never falls back past it (an outage, a newer format), so the run is not
    recoverable now, though an older checkpoint passed validation; an older unreadable one
    blocks nothing."""
    unread = Entry("a", 30, tiers=["hot"], manifest_error="S3 GetObject failed after 10 attempts", manifest_unread=True)
    old_unread = Entry("b", 1, tiers=["hot"], manifest_error="denied", manifest_unread=True)
    a, b = recoverable.run_statuses(
        [entry("a", 20, ok=True), unread, old_unread, entry("b", 5, ok=True)], [], {}, now=NOW, rpo_target_s=HOUR
    )
    assert (a.ready_step, a.blocked_step, a.recoverable) == (20, 30, False)
    assert a.row(NOW)["recoverable"] == "NO: stops at step 30" and a.attention_line() == "1 of 2 need attention"
    assert (b.ready_step, b.blocked_step, b.recoverable) == (5, None, True)
    assert recoverable.answer([a, b]) == (
        "NO: a restore of a stops at step 30, whose commit record could not be read; 2 of 4 checkpoints need attention"
    )
