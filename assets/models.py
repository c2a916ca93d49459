"""The deployed model: promotions and rollbacks of registry aliases, as materializations.

One asset, ``deployed_model``, whose every materialization is a change to what is
deployed (a new version and alias move, or a rollback), with metadata naming the
source checkpoint partition, its manifest digest, training config and data: the
lineage from a deployed model back to the bytes it came from, in the asset's history.
The promotion and rollback jobs are this asset with different run config; the work
is ``ckptflow.lifecycle.promote``. Every materialization shows all three aliases
(``latest``, ``stable``, ``fallback``) with the version and source partition of each.
"""

from collections.abc import Mapping

import pandas as pd
from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset

from assets.checkpoints import checkpoint, evaluation
from assets.metadata import size, throughput
from assets.partitions import parse_checkpoint_key, partition_keys
from assets.progress import logged_progress
from ckptflow.errors import CkptflowError
from ckptflow.interop.registry import ALIASES, Registry, describe
from resources import ArchiveTierResource, CheckpointStoreResource, RegistryResource


class DeployConfig(Config):
    """``action``: "promote" (export + register + move ``stage``) or "rollback" (stable <- fallback)."""

    action: str = "promote"
    model: str = "tinylm"
    partition_key: str = ""  # empty: the best validated checkpoint by ``metric``
    metric: str = "val_loss"
    mode: str = "min"
    stage: str = "latest"  # "latest" or "stable" (stable also moves the old stable to fallback)
    dtype: str = ""  # "" (as saved), "bf16", "fp16", "fp32", or "int8" (nn.Linear weights, per-row scales)
    key: str = "model"  # top-level state key of the weights to export
    allow_fp16_overflow: bool = False  # fp16: write inf for values beyond its range instead of failing


def aliases_metadata(reg: Registry, model: str, held: Mapping[tuple[str, int], str]) -> dict:
    """Each of latest / stable / fallback: its version and source partition (or "not set"),
    plus one table. ``held``: the partition this instance holds for each checkpoint
    (``partition_keys``), named instead of the checkpoint's name where the two differ."""
    aliases = reg.aliases(model)
    metadata: dict = {}
    rows = []
    for alias in ALIASES:
        if alias not in aliases:
            metadata[alias] = "not set"
            continue
        v = reg.get(model, aliases[alias])
        source = held.get((v.run, v.step), v.partition_key)
        metadata[alias] = f"v{v.version} from {source} (manifest {v.manifest_digest[:12]}…)"
        metadata[f"alias/{alias}"] = v.version
        metadata[f"alias/{alias}/source_partition"] = source
        rows.append({"alias": alias, **describe(v), "partition_key": source})
    metadata["aliases"] = MetadataValue.md(pd.DataFrame(rows).to_markdown(index=False) if rows else "(no aliases)")
    return metadata


@asset(group_name="models", deps=[checkpoint, evaluation], kinds={"safetensors"})
def deployed_model(
    context: AssetExecutionContext,
    config: DeployConfig,
    store: CheckpointStoreResource,
    archive: ArchiveTierResource,
    registry: RegistryResource,
) -> MaterializeResult:
    """What is deployed, after a promotion or a rollback; metadata carries the lineage. A
    promotion logs the export's progress (checkpoint bytes read, the rate) as it goes; those
    bytes, the promotion's time and their rate over it (upload and registration included),
    and the bytes of the model's files are metadata; so is ``passed_over``: promoting by
    metric (on the scale a ``Best`` restore reading the archive too ranks on), the hot
    checkpoints that were no candidate and why, as a ``Best`` restore's: the first
    ``SHOWN``, and ``passed_over_count`` of them all."""
    from ckptflow.lifecycle.promote import (  # torch: only in this asset's runs
        SHOWN,
        PromotionRequest,
        passed_over_lines,
        promote,
        rollback,
    )

    reg = registry.open()
    figures: dict = {}
    try:
        if config.action == "promote":
            request = PromotionRequest(
                config.model,
                parse_checkpoint_key(config.partition_key) if config.partition_key else None,
                metric=config.metric,
                mode=config.mode,
                stage=config.stage,
                dtype=config.dtype,
                key=config.key,
                allow_fp16_overflow=config.allow_fp16_overflow,
            )
            chosen = config.partition_key or f"the best checkpoint by {config.metric}"
            with logged_progress(context, f"exporting {chosen} as {config.model}") as meter:
                promotion = promote(store.open(), reg, request, archive=archive.open(), progress=meter)
            version = promotion.registered
            context.log.info(f"registered {config.model} v{version.version} from {version.partition_key}")
            passed_over = promotion.passed_over
            if passed_over:
                lines = "\n".join(passed_over_lines(passed_over))
                context.log.warning(f"passed over {len(passed_over)} hot checkpoints:\n{lines}")
            figures = {
                "passed_over": MetadataValue.json(
                    [{"run": run, "step": step, "why": why} for run, step, why in passed_over[:SHOWN]]
                ),
                "passed_over_count": MetadataValue.int(len(passed_over)),
                **size("exported", meter.done),
                **throughput("promotion", meter.done, meter.seconds),
                **size("model", sum(f["size"] for f in version.files.values())),
            }
        elif config.action == "rollback":
            version = rollback(reg, config.model)
        else:
            raise Failure(f"action must be 'promote' or 'rollback', got {config.action!r}")
    except CkptflowError as e:
        raise Failure(str(e)) from None
    data = version.lineage.get("data")
    held = partition_keys(context.instance)
    return MaterializeResult(
        metadata={
            "action": config.action,
            "model": config.model,
            "version": version.version,
            "source_partition": held.get((version.run, version.step), version.partition_key),
            "manifest_digest": version.manifest_digest,
            "files": MetadataValue.json(version.files),
            "export": MetadataValue.json(version.export),
            **figures,
            "training_config": MetadataValue.json(version.lineage.get("training_config") or {}),
            "data": MetadataValue.json(data) if isinstance(data, (dict, list)) else str(data),
            "metrics": MetadataValue.json((version.lineage.get("evaluation") or {}).get("metrics") or {}),
            **aliases_metadata(reg, config.model, held),
        }
    )
