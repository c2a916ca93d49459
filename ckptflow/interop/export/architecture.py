"""What a model's structure says about its tensors: which names are one shared tensor,
and which are ``nn.Linear`` weights.

A checkpoint holds every state-dict name, tied ones included (``lm_head.weight`` and
``transformer.wte.weight`` are two entries with the same bytes), but not that they are
tied: equal bytes do not prove it (every fresh LayerNorm weight is all ones). The
structure does. For a transformers model it comes from its config (``architectures``)
through transformers, building the model on the meta device (no memory, no weights);
for any other model from the tie groups the ``Checkpointer`` saw at save time (the
manifest's ``tied``: names sharing one storage) and any the run recorded in its metadata.
``model_metadata(model)`` is what a trainer records in the save's metadata for either; a
config can also be given at export (``--config``), and must then fit the tensors saved.
Shared names are the state-dict names of one parameter object, the first one (in
registration order, the owner transformers and ``safetensors.torch.load_model`` keep)
first, as ``safetensors.torch.save_model`` groups them.

A model also registers buffers it does not save (``persistent=False``: BERT's
``embeddings.position_ids``, which older transformers wrote into ``model.safetensors``, so
an imported file may still hold it). The structure names them (``unsaved``); an export
leaves them out, as ``save_pretrained`` does: ``from_pretrained`` rebuilds them from the
config, and a strict ``load_state_dict`` refuses them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckptflow.errors import CkptflowError
from ckptflow.format.manifest import Manifest
from ckptflow.interop.source_files import read_json_file

MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True)
class Architecture:
    name: str
    shared: tuple[tuple[str, ...], ...]  # groups of state-dict names of one tensor; the kept one first
    linear_weights: frozenset[str]  # ``<module>.weight`` of every nn.Linear
    linear_modules: frozenset[str]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # state-dict name -> shape (from a config)
    unsaved: frozenset[str] = frozenset()  # buffers the model registers but does not save (persistent=False)


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
    saved = model.state_dict()
    return Architecture(
        name=name,
        shared=tuple(tuple(g) for g in tied_weights(model)),
        linear_weights=frozenset(f"{m}.weight" for m in linear),
        linear_modules=frozenset(linear),
        shapes={n: tuple(t.shape) for n, t in saved.items()},
        unsaved=frozenset(n for n, _ in model.named_buffers(remove_duplicate=False) if n not in saved),
    )


def drop_unsaved(arch: Architecture, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(``tensors`` without the buffers ``arch``'s model does not save, the names left out).

    A checkpoint imported from a file an older transformers wrote holds such buffers
    (BERT's ``embeddings.position_ids``); the model's own ``save_pretrained`` leaves them
    out, ``from_pretrained`` rebuilds them from the config (it ignores them in a file, or
    warns of unexpected keys), and ``load_state_dict(strict=True)`` refuses them. So the
    export writes what the model saves, and the header names what it left out."""
    dropped = sorted(n for n in tensors if n in arch.unsaved and n not in arch.shapes)
    return {n: t for n, t in tensors.items() if n not in dropped}, dropped


class _TooLarge(Exception):
    """Raised inside a model's constructor once it has registered more tensors than allowed."""


@contextlib.contextmanager
def _tensor_budget(limit: int | None) -> Iterator[None]:
    """Stop a model being built (in this thread) once it registers more than ``limit``
    parameters and buffers: the meta device allocates no memory, but each layer costs its
    Python objects and milliseconds, so a config declaring a million layers would take an
    hour and tens of GB before a single tensor is compared."""
    if limit is None:
        yield
        return
    count, thread = 0, threading.get_ident()

    def hook(module: nn.Module, name: str, tensor: Any) -> None:
        nonlocal count
        if threading.get_ident() == thread:
            count += 1
            if count > limit:
                raise _TooLarge

    handles = [
        nn.modules.module.register_module_parameter_registration_hook(hook),
        nn.modules.module.register_module_buffer_registration_hook(hook),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _no_downloads() -> Iterator[None]:
    """The Hugging Face Hub offline while a model is built from a config: transformers
    resolves a sub-config named by ``backbone`` on the Hub (``repo_exists``, then its
    config.json) and a pretrained backbone's weights there, so an imported config.json could
    send this process to any repository it names. The structure needs none of that."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        yield
        return
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def from_transformers_config(
    config: Mapping[str, Any], *, fix: str | None = None, max_tensors: int | None = None
) -> Architecture:
    """Build ``config["architectures"][0]`` on the meta device and read its structure
    (``fix``: what to do about a config that names no class). ``max_tensors``: refuse a
    config whose model registers more parameters and buffers than that, stopping the
    build there (a config read from a file describes at most what its files hold)."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise CkptflowError(
            "the model config has no 'architectures' entry naming its transformers class "
            f"(e.g. ['GPT2LMHeadModel']); {fix or 'record ckptflow.interop.export.model_metadata(model) when saving'}"
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
        raise CkptflowError(
            f"transformers {transformers.__version__} has no model class {architectures[0]!r} (a model whose code "
            "ships with its weights, trust_remote_code, is not built: ckptflow runs no code from a model directory); "
            "the structure is needed to tell tied weights apart: import (or export) without that config.json, "
            "or with one naming a class transformers ships that has the same structure"
        )
    try:
        with torch.device("meta"), _tensor_budget(max_tensors), _no_downloads():
            built = {**config, "use_pretrained_backbone": False}  # the weights are the checkpoint's
            model = cls(cls.config_class.from_dict(built))
    except _TooLarge:
        raise CkptflowError(
            f"the model config declares a larger {architectures[0]} than its files hold: building it registered "
            f"more than {max_tensors} tensors (its layer or expert counts?); refused before building the rest. "
            "Fix the config to describe the weights saved"
        ) from None
    except Exception as e:  # transformers and huggingface_hub raise their own kinds for a config of the wrong types
        if type(e).__name__ == "OfflineModeIsEnabled":
            raise CkptflowError(
                f"the model config of {architectures[0]} names something to fetch from the Hugging Face Hub ({e}); "
                "ckptflow builds the model from the config alone and downloads nothing: give the sub-config inline "
                "(backbone_config rather than backbone)"
            ) from None
        raise CkptflowError(
            f"the model config does not build {architectures[0]} ({type(e).__name__}: {e}); fix the config"
        ) from None
    return from_module(model, architectures[0])


def structure(
    manifest: Manifest, key: str, given: Mapping[str, Any] | None = None
) -> tuple[Architecture, dict[str, Any] | None]:
    """(the structure of the model under state entry ``key``, its config.json or None).

    A transformers config (``given`` at export, else the run's ``model_config``) decides;
    without one, the tie groups the saver saw (the manifest's ``tied``, names under
    ``key``) and those the run recorded (metadata ``tied_weights``)."""
    metadata = dict(manifest.metadata)
    config = given if given is not None else metadata.get("model_config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise CkptflowError(
                "the model config " + ("given" if given is not None else "in the checkpoint's metadata 'model_config'")
                + " is not a JSON object"
            )  # fmt: skip
        fix = "add it to the config given (model.save_pretrained writes it)" if given is not None else None
        return from_transformers_config(config, fix=fix), dict(config)
    recorded = metadata.get("tied_weights") or []
    if not isinstance(recorded, list) or not all(
        isinstance(g, list) and all(isinstance(n, str) for n in g) for g in recorded
    ):
        raise CkptflowError("the checkpoint's metadata 'tied_weights' is not a list of lists of tensor names")
    prefix = key.rstrip(".") + "."
    saw = [[n[len(prefix) :] for n in group if n.startswith(prefix)] for group in manifest.tied]
    groups = [tuple(g) for g in recorded] + [tuple(g) for g in saw if len(g) > 1]
    return Architecture(name="", shared=tuple(groups), linear_weights=frozenset(), linear_modules=frozenset()), None


def check_fits(
    arch: Architecture, tensors: Mapping[str, torch.Tensor], where: str, *, recorded_for: str | None = None
) -> None:
    """Refuse a config that does not describe the tensors saved (names and shapes): its
    config.json would load them wrongly, or not at all (transformers initialises a missing
    layer at random with a warning). ``tensors``: one name per tie. ``recorded_for``: the
    state entry exported, when the config is the one the run recorded (not one given)."""
    aliases = {n for group in arch.shared for n in group[1:]}
    expected = {n: s for n, s in arch.shapes.items() if n not in aliases}
    saved = {n: tuple(t.shape) for n, t in tensors.items()}
    differ = sorted(n for n in expected.keys() & saved.keys() if expected[n] != saved[n])
    problems = [
        f"{what}: {', '.join(names[:5])}" + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
        for what, names in (
            ("not in the checkpoint", sorted(expected.keys() - saved.keys())),
            ("not in the config's model", sorted(saved.keys() - expected.keys())),
            ("shape saved / in the config", [f"{n} {list(saved[n])} / {list(expected[n])}" for n in differ]),
        )
        if names
    ]
    if problems and recorded_for is not None:
        raise CkptflowError(
            f"the model config the run recorded ({arch.name}, metadata 'model_config') does not describe the "
            f"tensors under {recorded_for!r} of {where}: {'; '.join(problems)}. Export the entry it describes "
            "(--key), or pass the config.json of the model under this one (--config)"
        )
    if problems:
        raise CkptflowError(
            f"the config given ({arch.name}) does not describe {where}: {'; '.join(problems)}. "
            "Pass the config.json of the model that was trained"
        )


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A model's config.json, for ``--config``: a JSON object, read bounded."""
    config = read_json_file(path, limit=MAX_CONFIG_BYTES, what="--config ")
    if not isinstance(config, dict):
        raise CkptflowError(
            f"--config {path} holds a {type(config).__name__}, not a JSON object (a model's config.json)"
        )
    return config
