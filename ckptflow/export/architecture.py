"""What a model's structure says about its tensors: which names are one shared tensor,
and which are ``nn.Linear`` weights.

A checkpoint holds every state-dict name, tied ones included (``lm_head.weight`` and
``transformer.wte.weight`` are two entries with the same bytes), but not that they are
tied: equal bytes do not prove it (every fresh LayerNorm weight is all ones). The
structure does. For a transformers model it comes from its config (``architectures``)
through transformers, building the model on the meta device (no memory, no weights);
for any other model from its tied groups. ``model_metadata(model)`` is what a trainer
records in the save's metadata for either.
Shared names are the state-dict names of one parameter object, the first one (in
registration order, the owner transformers and ``safetensors.torch.load_model`` keep)
first, as ``safetensors.torch.save_model`` groups them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptflow.errors import CkptflowError


@dataclass(frozen=True)
class Architecture:
    name: str
    shared: tuple[tuple[str, ...], ...]  # groups of state-dict names of one tensor; the kept one first
    linear_weights: frozenset[str]  # ``<module>.weight`` of every nn.Linear
    linear_modules: frozenset[str]


def model_metadata(model: nn.Module) -> dict[str, Any]:
    """What an export needs to know of ``model``'s structure, as save metadata:
    ``ck.save(step, state, metadata={**model_metadata(model), "val_loss": v})``.

    A transformers model: ``model_config`` (its config, naming its class), which also
    becomes the export's config.json. Any other model: ``tied_weights``, if it has any.
    """
    config: Any = getattr(model, "config", None)
    if callable(getattr(config, "to_json_string", None)):
        as_dict = json.loads(config.to_json_string(use_diff=False))
        return {"model_config": {**as_dict, "architectures": [type(model).__name__]}}
    tied = tied_weights(model)
    return {"tied_weights": tied} if tied else {}


def tied_weights(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor in ``model`` (first: the one to keep)."""
    keys = set(model.state_dict())
    owners: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if name in keys:
            owners.setdefault(id(tensor), []).append(name)
    return [names for names in owners.values() if len(names) > 1]


def from_module(model: nn.Module, name: str) -> Architecture:
    linear = {m for m, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    return Architecture(
        name=name,
        shared=tuple(tuple(g) for g in tied_weights(model)),
        linear_weights=frozenset(f"{m}.weight" for m in linear),
        linear_modules=frozenset(linear),
    )


def from_transformers_config(config: Mapping[str, Any]) -> Architecture:
    """Build ``config["architectures"][0]`` on the meta device and read its structure."""
    architectures = config.get("architectures") or []
    if not architectures or not isinstance(architectures[0], str):
        raise CkptflowError(
            "the model config has no 'architectures' entry naming its transformers class "
            "(e.g. ['GPT2LMHeadModel']); record ckptflow.export.model_metadata(model) when saving"
        )
    try:
        import transformers
    except ImportError:
        raise CkptflowError(
            "exporting a transformers model (its config names "
            f"{architectures[0]}) needs transformers installed: pip install 'ckptflow[hf]'"
        ) from None
    cls = getattr(transformers, architectures[0], None)
    if cls is None:
        raise CkptflowError(f"transformers {transformers.__version__} has no model class {architectures[0]!r}")
    with torch.device("meta"):
        model = cls(cls.config_class.from_dict(dict(config)))
    return from_module(model, architectures[0])
