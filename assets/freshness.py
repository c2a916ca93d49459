"""RPO freshness: a warning on ``checkpoint`` when no checkpoint has become
recovery-ready (committed and validated) for longer than the RPO target.

A non-blocking check of severity WARN on the checkpoint asset as a whole (not per
partition), evaluated every five minutes by the lifecycle automation sensor. The
target is ``CKPTFLOW_RPO_TARGET`` (a duration such as ``30m``, ``1h``; default 1h):
how much training an operator accepts to lose to a crash. The numbers come from
``ckptflow.reports.recoveries`` over the store (the commit time of the newest checkpoint whose
validation passed), so they agree with ``ckptflow stats``.
"""

import os
import time

from dagster import AssetCheckKey, AssetCheckResult, AssetCheckSeverity, AutomationCondition, MetadataValue, asset_check

from assets.checkpoints import checkpoint
from ckptflow.catalog.gc import parse_duration
from ckptflow.reports import recoveries
from ckptflow.reports.units import human_duration
from resources import CheckpointStoreResource

RPO_TARGET_ENV = "CKPTFLOW_RPO_TARGET"
DEFAULT_RPO_TARGET = "1h"
# typed as a check's condition: cron_tick_passed leaves its key type open, which `&` would take as an asset's
_FIVE_MINUTE_TICK: AutomationCondition[AssetCheckKey] = AutomationCondition.cron_tick_passed("*/5 * * * *")
EVERY_5_MINUTES = (_FIVE_MINUTE_TICK & ~AutomationCondition.in_progress()).with_label("every 5 minutes")


RPO_FRESHNESS_KEY = AssetCheckKey(checkpoint.key, "rpo_freshness")


def rpo_target_s() -> float:
    text = os.environ.get(RPO_TARGET_ENV, "").strip() or DEFAULT_RPO_TARGET
    try:
        return parse_duration(text)
    except ValueError as e:
        raise ValueError(f"{RPO_TARGET_ENV}={text!r} is not a duration such as 30m or 1h: {e}") from None


@asset_check(asset=checkpoint, name="rpo_freshness", blocking=False, automation_condition=EVERY_5_MINUTES)
def rpo_freshness(store: CheckpointStoreResource) -> AssetCheckResult:
    """Warns when the newest recovery-ready checkpoint (any run) is older than the RPO target."""
    target = rpo_target_s()
    now = time.time()
    state = recoveries.freshness(recoveries.store_metrics(store.open(), now=now), target, now=now)
    metadata = {
        "rpo_target_s": MetadataValue.float(target),
        "rpo_target": MetadataValue.text(human_duration(target)),
    }
    if state.age_s is None:
        metadata["newest_recovery_ready"] = MetadataValue.text("none: no checkpoint has passed validation yet")
    else:
        metadata.update(
            {
                "age_s": MetadataValue.float(round(state.age_s, 1)),
                "age": MetadataValue.text(human_duration(state.age_s)),
                "newest_recovery_ready_run": MetadataValue.text(state.run or ""),
                "newest_recovery_ready_committed_at": MetadataValue.timestamp(state.newest_ready_at or 0.0),
            }
        )
    return AssetCheckResult(passed=state.ok, severity=AssetCheckSeverity.WARN, metadata=metadata)
