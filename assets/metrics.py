"""Operational numbers: checkpoint frequency, storage per tier, recoveries and their
success rate, time from commit to recovery-ready, RPO and RTO.

A snapshot of the store's records (``ckptflow.reports.recoveries``, ``ckptflow.reports.stats``: the
same numbers as ``ckptflow stats``), refreshed with the inventory. Every figure is
numeric metadata, so the UI plots it over materializations: store-wide figures, and
the headline figures of each run that committed checkpoints in the window (prefixed
``<run>/``; at most ``MAX_RUNS`` runs, the most active first).
"""

import statistics
import time

import pandas as pd
from dagster import Config, MetadataValue, Output, asset

from assets.checkpoints import checkpoint
from assets.freshness import rpo_target_s
from assets.inventory import GROUP, REFRESH, markdown
from assets.metadata import rounded, size
from ckptflow.catalog.gc import parse_duration
from ckptflow.reports import recoveries, stats
from ckptflow.reports.recoverable import rpo_against_target
from ckptflow.reports.units import human_duration
from resources import ArchiveTierResource, CheckpointStoreResource

MAX_RUNS = 10


class RecoveryConfig(Config):
    window: str = "1d"  # RPO and checkpoint frequency look at this much history
    detection: str = "0s"  # time to notice a crashed job and restart it: added to restore times for RTO


def _worst(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _seconds(figures: dict[str, float | None]) -> dict[str, MetadataValue]:
    """Durations as plotted floats; a figure with no data yet is left out, not plotted as 0."""
    return {k: MetadataValue.float(rounded(v)) for k, v in figures.items() if v is not None}


def _row(m: recoveries.RunMetrics) -> dict:
    return {
        "run": m.run,
        "checkpoints": m.checkpoints,
        "in window": m.checkpoints_in_window,
        "save every": human_duration(m.save_interval_s),
        "ready after (median / worst)": f"{human_duration(m.ready_s)} / {human_duration(m.ready_worst_s)}",
        "RPO (target)": rpo_against_target(m.rpo_s, rpo_target_s()),
        "recoveries (ok)": f"{m.recoveries} ({m.recoveries_ok})",
        "rejected restores": m.rejected,
        "RTO (median / worst)": f"{human_duration(m.rto_median_s)} / {human_duration(m.rto_worst_s)}",
        "recovered to": ", ".join(f"{name} x{count}" for name, count in sorted(m.selectors.items())) or "-",
    }


@asset(group_name=GROUP, deps=[checkpoint], automation_condition=REFRESH, kinds={"pandas"})
def recovery_metrics(
    config: RecoveryConfig, store: CheckpointStoreResource, archive: ArchiveTierResource
) -> Output[pd.DataFrame]:
    """Per run and store-wide: checkpoints in the window and the median save interval,
    commit to recovery-ready (median, worst), RPO (the longest gap between
    recovery-ready checkpoints in the window), recoveries, successes, fallbacks, RTO
    (detection plus median and worst restore time), and bytes per tier. Restores rejected
    because the state passed did not fit the checkpoint (the caller's side) are counted
    apart, ``recoveries_rejected``, and left out of the recoveries and their success rate."""
    hot = store.open()
    window, detection = parse_duration(config.window), parse_duration(config.detection)
    runs = recoveries.store_metrics(hot, now=time.time(), window_s=window, detection_s=detection)
    df = pd.DataFrame([m.as_dict() for m in runs])
    total = sum(m.recoveries for m in runs)
    ok = sum(m.recoveries_ok for m in runs)
    metadata: dict = {
        "window": MetadataValue.text(human_duration(window)),
        "checkpoints_in_window": sum(m.checkpoints_in_window for m in runs),
        **_seconds(
            {
                "save_interval_s": statistics.median(known)
                if (known := [m.save_interval_s for m in runs if m.save_interval_s is not None])
                else None,
                "ready_s": _worst(m.ready_s for m in runs),
                "ready_worst_s": _worst(m.ready_worst_s for m in runs),
                "rpo_s": _worst(m.rpo_s for m in runs),
                "rto_median_s": _worst(m.rto_median_s for m in runs),
                "rto_worst_s": _worst(m.rto_worst_s for m in runs),
            }
        ),
        "rpo": rpo_against_target(_worst(m.rpo_s for m in runs), rpo_target_s()),
        "rpo_target_s": MetadataValue.float(rpo_target_s()),
        "recoveries": total,
        "recoveries_ok": ok,
        "recovery_success_rate": MetadataValue.float(round(ok / total, 4) if total else 1.0),
        "fallbacks": sum(m.fallbacks for m in runs),
        "recoveries_rejected": sum(m.rejected for m in runs),
        "detection_s": MetadataValue.float(detection),
        **size("hot_stored", stats.store_stats(hot).stored_bytes),
        **size("archive_stored", stats.store_stats(archive.open()).stored_bytes),
    }
    active = sorted((m for m in runs if m.checkpoints_in_window), key=lambda m: -m.checkpoints_in_window)
    for m in active[:MAX_RUNS]:
        metadata[f"{m.run}/checkpoints_in_window"] = m.checkpoints_in_window
        metadata.update(_seconds({f"{m.run}/rpo_s": m.rpo_s, f"{m.run}/ready_s": m.ready_s}))
    metadata["table"] = markdown(pd.DataFrame([_row(m) for m in runs]))
    return Output(df, metadata=metadata)
