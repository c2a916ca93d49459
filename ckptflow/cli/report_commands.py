"""The CLI's commands that report numbers about a store: ``stats`` (bytes, dedup,
compression, RPO / RTO and costs per run) and ``advise`` (how often a run should
checkpoint).

Apart from ``ckptflow.cli.commands`` because they render the read-only reports of
``ckptflow.reports`` (tables of figures), while those commands act on checkpoints.
"""

from __future__ import annotations

import argparse

from ckptflow.cli import advise
from ckptflow.cli import costs as cost_section
from ckptflow.cli.commands import open_existing, require_run
from ckptflow.cli.output import PROG, json_text, ratio, table, warn
from ckptflow.reports import recoveries
from ckptflow.reports.stats import store_stats
from ckptflow.reports.units import human_bytes, human_duration


def cmd_advise(args: argparse.Namespace) -> int:
    store = open_existing(args.root)
    require_run(store, args.run)
    return advise.run(store, args)


def cmd_stats(args: argparse.Namespace) -> int:
    store = open_existing(args.root)
    stats = store_stats(store, count_damaged=True)
    archive = store_stats(open_existing(args.archive)) if args.archive else None
    operations = recoveries.store_metrics(store, window_s=args.window, detection_s=args.detection)
    costs = cost_section.report(store, args, open_existing)
    for problem in stats.unreadable_manifests:
        warn(f"not counted: {problem}")
    if args.json:
        doc = {**stats.as_dict(), "operations": [m.as_dict() for m in operations], "costs": costs.as_dict()}
        if archive is not None:
            doc["archive"] = archive.as_dict()["store"]
        print(json_text(doc))
        return 0
    headers = ["RUN", "CHECKPOINTS", "LOGICAL", "UNIQUE", "STORED", "DEDUP", "COMPRESSION"]
    rows = [
        [
            r.run,
            str(r.checkpoints),
            human_bytes(r.logical_bytes),
            human_bytes(r.unique_bytes),
            human_bytes(r.stored_bytes),
            ratio(r.dedup_ratio),
            ratio(r.compression_ratio),
        ]
        for r in stats.runs
    ]
    rows.append(
        [
            "(store)",
            str(stats.checkpoints),
            human_bytes(stats.logical_bytes),
            human_bytes(stats.unique_bytes),
            human_bytes(stats.stored_bytes),
            ratio(stats.dedup_ratio),
            ratio(stats.compression_ratio),
        ]
    )
    print(table(headers, rows, right={1, 2, 3, 4, 5, 6}))
    print(
        f"chunk files: {stats.chunk_files} ({human_bytes(stats.chunk_file_bytes)}); unreferenced: "
        f"{stats.unreferenced_chunks} ({human_bytes(stats.unreferenced_bytes)})"
        + (
            ""
            if not stats.unreferenced_chunks
            else ", not reclaimable while a commit record's chunks cannot be told (GC sweeps nothing)"
            if stats.garbage_untold
            else f", reclaimable with `{PROG} gc` once older than the grace period"
        )
    )
    if stats.damaged_chunks:
        warn(
            f"{stats.damaged_chunks} chunk object(s) are recorded damaged: the next save of a job that still holds "
            f"their content writes them anew; `{PROG} verify --all` names the checkpoints that need them"
        )
    for r in stats.runs:
        if r.missing_chunks:
            warn(f"run {r.run} references {r.missing_chunks} chunk(s) missing from the store; run `{PROG} verify`")
    tiers = f"bytes per tier: hot {human_bytes(stats.stored_bytes)} stored ({stats.checkpoints} checkpoints)"
    if archive is not None:
        tiers += f"; archive {human_bytes(archive.stored_bytes)} stored ({archive.checkpoints} checkpoints)"
    print(tiers)
    print()
    _print_operations(operations, args.window, args.detection)
    print()
    print(cost_section.render(costs))
    return 0


def _print_operations(operations: list[recoveries.RunMetrics], window: float, detection: float) -> None:
    """Checkpoint frequency, commit -> recovery-ready, RPO, recoveries and RTO per run."""
    pair = lambda a, b: f"{human_duration(a)} / {human_duration(b)}"
    headers = ["RUN", f"IN {human_duration(window)}", "SAVE EVERY", "READY AFTER (MED / WORST)", "RPO"]
    headers += ["RECOVERIES", "SUCCEEDED", "FELL BACK", "REJECTED", "RTO (MED / WORST)"]
    rows = [
        [
            m.run,
            str(m.checkpoints_in_window),
            human_duration(m.save_interval_s),
            pair(m.ready_s, m.ready_worst_s),
            human_duration(m.rpo_s),
            str(m.recoveries),
            str(m.recoveries_ok),
            str(m.fallbacks),
            str(m.rejected),
            pair(m.rto_median_s, m.rto_worst_s),
        ]
        for m in operations
    ]
    print(table(headers, rows, right=set(range(1, len(headers)))))
    print(
        f"RPO: the longest gap between recovery-ready (validated) checkpoints committed in the last "
        f"{human_duration(window)}; RTO: detection ({human_duration(detection)}, --detection) + restore time"
    )
    if any(m.rejected for m in operations):
        print(
            "REJECTED: restores refused because the state passed does not have the checkpoint's structure "
            "(StateMismatchError: the caller's side, not the checkpoint's); not counted as recoveries, "
            "so not in the success rate"
        )
