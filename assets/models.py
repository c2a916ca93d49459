"""The deployed model: promotions and rollbacks of registry aliases, as materializations.

One asset, ``deployed_model``, whose every materialization is a change to what is
deployed (a new version and alias move, or a rollback), with metadata naming the
source checkpoint partition, its manifest digest, training config and data: the
lineage from a deployed model back to the bytes it came from, in the asset's history.
The promotion and rollback jobs are this asset with different run config.
"""

import os
import tempfile

import pandas as pd
from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue, asset

from assets.checkpoints import checkpoint, evaluation
from assets.partitions import checkpoint_key, parse_checkpoint_key
from ckptflow import catalog, inventory, lifecycle
from ckptflow.export import export_safetensors
from ckptflow.quantize import export_int8
from ckptflow.registry import ModelVersion, Registry, describe
from resources import CheckpointStoreResource, EvaluatorResource, RegistryResource


class DeployConfig(Config):
    """``action``: "promote" (export + register + move ``stage``) or "rollback" (stable <- fallback)."""

    action: str = "promote"
    model: str = "tinylm"
    partition_key: str = ""  # empty: the best validated checkpoint by ``metric``
    metric: str = "val_loss"
    mode: str = "min"
    stage: str = "latest"  # "latest" or "stable" (stable also moves the old stable to fallback)
    dtype: str = ""  # "" (as saved), "bf16", "fp16", "fp32", or "int8" (per-row quantized weights + scales)
    key: str = "model"  # top-level state key of the weights to export


def choose_checkpoint(entries: list[inventory.Entry], metric: str, mode: str) -> inventory.Entry:
    """The best checkpoint by ``metric`` among those that passed validation."""
    scored = [e for e in entries if e.validation == "passed" and "hot" in e.tiers and metric in e.metrics]
    if not scored:
        raise Failure(f"no validated checkpoint has an evaluation metric {metric!r}; evaluate some first")
    sign = 1 if mode == "min" else -1
    return min(scored, key=lambda e: (sign * e.metrics[metric], -e.step))


def _aliases_table(reg: Registry, model: str) -> tuple[dict, MetadataValue]:
    aliases = reg.aliases(model)
    rows = [{"alias": a, **describe(reg.get(model, v))} for a, v in sorted(aliases.items())]
    return aliases, MetadataValue.md(pd.DataFrame(rows).to_markdown(index=False) if rows else "(no aliases)")


def _promote(context: AssetExecutionContext, config: DeployConfig, store, reg: Registry, evaluator: str) -> ModelVersion:
    hot = store.open()
    if config.partition_key:
        run, step = parse_checkpoint_key(config.partition_key)
    else:
        best = choose_checkpoint(inventory.collect(hot), config.metric, config.mode)
        run, step = best.run, best.step
    validation = lifecycle.read_record(hot, run, step, "validation") or lifecycle.validate(hot, run, step)
    if not validation.get("ok"):
        raise Failure(f"refusing to promote {checkpoint_key(run, step)}: it failed validation ({validation.get('problems')})")
    manifest, digest = catalog.read_manifest(hot, run, step)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model.safetensors")
        if config.dtype == "int8":
            result = export_int8(hot, run, step, out, key=config.key)
        else:
            result = export_safetensors(hot, run, out, step=step, key=config.key, dtype=config.dtype or None)
        with open(result.path, "rb") as f:
            weights = f.read()
    evaluation_record = lifecycle.read_record(hot, run, step, "evaluation") or {}
    trainer = manifest.get("metadata") or {}
    version = reg.register(
        config.model, run=run, step=step, partition_key=checkpoint_key(run, step), manifest_digest=digest,
        artifact_bytes=weights, dtype=config.dtype or None,
        training_config={"kind": manifest["kind"], "world_size": manifest["world_size"], "codec": manifest.get("codec"),
                         **(trainer.get("config") or {})},
        data={"trainer": trainer.get("data", "see the training run"), "evaluator": evaluator,
              "evaluated_by": evaluation_record.get("evaluator")},
        metrics={**{k: v for k, v in trainer.items() if isinstance(v, (int, float))}, **(evaluation_record.get("metrics") or {})},
    )
    if config.stage == "stable":
        reg.promote(config.model, version.version)
    elif config.stage != "latest":
        raise Failure(f"stage must be 'latest' or 'stable', got {config.stage!r}")
    context.log.info(f"registered {config.model} v{version.version} from {version.partition_key}")
    return version


@asset(group_name="models", deps=[checkpoint, evaluation], kinds={"safetensors"})
def deployed_model(
    context: AssetExecutionContext, config: DeployConfig, store: CheckpointStoreResource,
    registry: RegistryResource, evaluator: EvaluatorResource,
) -> MaterializeResult:
    """What is deployed, after a promotion or a rollback; metadata carries the lineage."""
    reg = registry.open()
    if config.action == "promote":
        version = _promote(context, config, store, reg, evaluator.function)
    elif config.action == "rollback":
        reg.rollback(config.model)
        version = reg.resolve(config.model, "stable")
    else:
        raise Failure(f"action must be 'promote' or 'rollback', got {config.action!r}")
    aliases, table = _aliases_table(reg, config.model)
    return MaterializeResult(metadata={
        "action": config.action, "model": config.model, "version": version.version,
        "source_partition": version.partition_key, "manifest_digest": version.manifest_digest,
        "artifact": str(version.artifact.get("store_key") or version.artifact.get("path")),
        "training_config": MetadataValue.json(version.training_config), "data": MetadataValue.json(version.data),
        **{f"alias/{a}": v for a, v in aliases.items()}, "aliases": table,
    })
