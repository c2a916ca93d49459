"""The model card (README.md) of an exported model directory: where the weights came from.

Everything on it is fixed by what was exported (the checkpoint, its records at export
time, the export options), never the time of writing, so rebuilding a model version
from its checkpoint reproduces the card byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow import format as fmt
from ckptflow.manifest import Manifest


@dataclass(frozen=True)
class Lineage:
    """What a deployed model is: the exact commit it came from and what was known of it."""

    run: str
    step: int
    manifest_digest: str
    kind: str = ""
    validation: Mapping[str, Any] = field(default_factory=dict)  # {"ok", "chunks_checked", "tier", ...}
    evaluation: Mapping[str, Any] = field(default_factory=dict)  # {"evaluator", "metrics"}
    training_config: Mapping[str, Any] = field(default_factory=dict)
    data: Any = None  # the trainer's data reference (metadata "data")

    @property
    def partition_key(self) -> str:
        return fmt.checkpoint_name(self.run, self.step)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), sort_keys=True, default=str))

    @classmethod
    def of(cls, manifest: Manifest) -> Lineage:
        """What the commit itself says: the trainer's metadata ``config`` (the training
        config), ``data`` (a data reference) and the numbers it recorded (as metrics)."""
        trainer = dict(manifest.metadata)
        numbers = {k: v for k, v in trainer.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        config = trainer.get("config")
        return cls(
            run=manifest.run,
            step=manifest.step,
            manifest_digest=manifest.digest,
            kind=manifest.kind,
            evaluation={"evaluator": None, "metrics": numbers},
            training_config={
                "world_size": manifest.world_size,
                "codec": manifest.codec,
                **(config if isinstance(config, dict) else {}),
            },
            data=trainer.get("data"),
        )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Lineage:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


def _json(value: Any) -> str:
    return "```json\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```"


def render(lineage: Lineage, *, export: Mapping[str, Any], tensors: int, architecture: str) -> str:
    """README.md: YAML front matter (as the Hugging Face hub reads it), then the lineage."""
    validation = lineage.validation
    verdict = "not validated"
    if validation:
        verdict = "passed" if validation.get("ok") else "FAILED: " + "; ".join(map(str, validation.get("problems", [])))
        if validation.get("chunks_checked") is not None:
            verdict += f" ({validation['chunks_checked']} chunks re-hashed in {validation.get('tier', 'the store')})"
    metrics = (lineage.evaluation or {}).get("metrics") or {}
    lines = [
        "---",
        "library_name: " + ("transformers" if architecture else "safetensors"),
        "tags:",
        "- ckptflow",
        "---",
        "",
        f"# {architecture or 'Model'} from {lineage.partition_key}",
        "",
        "Exported by ckptflow from one committed checkpoint; every tensor was verified against",
        "its content address on the way.",
        "",
        "## Lineage",
        "",
        "| | |",
        "|---|---|",
        f"| run | `{lineage.run}` |",
        f"| step | {lineage.step} |",
        f"| checkpoint partition | `{lineage.partition_key}` |",
        f"| manifest digest (sha256) | `{lineage.manifest_digest}` |",
        f"| checkpoint kind | {lineage.kind or 'unknown'} |",
        f"| validation | {verdict} |",
        f"| evaluated by | {(lineage.evaluation or {}).get('evaluator') or 'not evaluated'} |",
        "",
        "## Evaluation",
        "",
        *([f"- {k}: {v}" for k, v in sorted(metrics.items())] or ["No evaluation results were recorded."]),
        "",
        "## Training config",
        "",
        _json(dict(lineage.training_config)) if lineage.training_config else "None recorded.",
        "",
        "## Data",
        "",
        _json(lineage.data) if lineage.data is not None else "No data reference was recorded.",
        "",
        "## Export",
        "",
        _json({**export, "tensors": tensors}),
        "",
    ]
    return "\n".join(lines)
