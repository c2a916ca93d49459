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

from ckptflow.chunks import lossy as lossy_codecs
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest


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


def _lossy_section(lossy: Mapping[str, Any]) -> list[str]:
    """What a card says first when the weights come from a lossy archive copy."""
    errors = lossy.get("error")
    errors = errors if isinstance(errors, Mapping) else {}
    return [
        "## Lossy copy",
        "",
        f"**These weights are not the checkpoint that was trained.** They come from a lossy archive copy "
        f"({lossy_codecs.describe(lossy)}) of the exact commit `{lossy.get('source_digest') or 'unknown'}`.",
        "",
        *[f"- {what}: RMS relative error {e.get('rms_relative_error')}, max abs error {e.get('max_abs_error')}"
          for what, e in sorted(errors.items()) if isinstance(e, Mapping)],
        "",
    ]  # fmt: skip


def render(
    lineage: Lineage,
    *,
    export: Mapping[str, Any],
    tensors: int,
    architecture: str,
    lossy: Mapping[str, Any] | None = None,
) -> str:
    """README.md: YAML front matter (as the Hugging Face hub reads it), then the lineage;
    first of all, for weights from a lossy copy (``lossy``: its record), that they are."""
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
        *(["- lossy"] if lossy is not None else []),
        "---",
        "",
        f"# {architecture or 'Model'} from {lineage.partition_key}",
        "",
        *(_lossy_section(lossy) if lossy is not None else []),
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
