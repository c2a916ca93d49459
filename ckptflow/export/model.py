"""Export one checkpoint's model weights: a safetensors file, or a model directory that
``transformers`` loads with ``from_pretrained``.

``--out x.safetensors`` writes one file. Any other ``--out`` is a directory in the
Hugging Face layout: ``model.safetensors`` (past ``max_shard_bytes``, shards and
``model.safetensors.index.json``), ``config.json`` when the run recorded its model config
(``ck.save(step, state, metadata={"model_config": model.config.to_dict()})``), and a
``README.md`` model card with the lineage. Tied tensors are written once; fp16 refuses
values it cannot hold; int8 is a format a loader dequantizes or refuses (``quantize``).
The same checkpoint and options always give the same bytes, so a deleted model version
can be rebuilt and checked against its recorded hashes.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckptflow import format as fmt
from ckptflow.errors import CkptflowError
from ckptflow.export.architecture import Architecture, from_transformers_config
from ckptflow.export.card import Lineage, render
from ckptflow.export.files import TIED_KEY, lineage_metadata, nbytes, write_json, write_safetensors, write_weights
from ckptflow.export.options import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES
from ckptflow.export.tensors import Progress, convert_dtype, load_tensors, newest_verified_step, write_once
from ckptflow.manifest import Manifest
from ckptflow.quantize import ERROR_BOUND, quantization_config, quantize_weights
from ckptflow.store import Store, open_store

CONFIG, CARD = "config.json", "README.md"
_CONFIG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def option_problems(key: str, dtype: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """What is wrong with these export options (the one place they are checked)."""
    out = []
    if dtype not in EXPORT_DTYPES:
        out.append(f"dtype {dtype!r} is not one of {EXPORT_DTYPES}")
    if not key:
        out.append("key is empty: name the state entry holding the weights (e.g. 'model')")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        out.append(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    return out


@dataclass(frozen=True)
class ExportOptions:
    """How to export; recorded with a model version, so the same files can be rebuilt."""

    key: str = "model"  # the state entry holding the weights
    dtype: str = ""  # "" as saved, "bf16", "fp16", "fp32", or "int8" (Linear weights quantized)
    allow_fp16_overflow: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES

    def __post_init__(self) -> None:
        problems = option_problems(self.key, self.dtype, self.max_shard_bytes)
        if problems:
            raise CkptflowError("export refused: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ExportResult:
    run: str
    step: int
    path: str  # the file, or the model directory
    tensors: int
    bytes: int  # tensor bytes written, after any conversion
    digest: str  # the source manifest's digest, also in every file's metadata
    files: tuple[str, ...] = ()  # names in the directory (a file export: its own name)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer steps passed over: each proved damaged


@dataclass(frozen=True)
class Prepared:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    config: dict[str, Any] | None  # config.json
    architecture: str
    manifest: Manifest


def _structure(metadata: dict[str, Any]) -> tuple[Architecture, dict[str, Any] | None]:
    model_config = metadata.get("model_config")
    if model_config is not None:
        if not isinstance(model_config, dict):
            raise CkptflowError("the checkpoint's metadata 'model_config' is not a JSON object")
        return from_transformers_config(model_config), model_config
    tied = metadata.get("tied_weights") or []
    if not isinstance(tied, list) or not all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in tied):
        raise CkptflowError("the checkpoint's metadata 'tied_weights' is not a list of lists of tensor names")
    return Architecture("", tuple(tuple(g) for g in tied), frozenset(), frozenset()), None


def prepare(store: Store, run: str, step: int, options: ExportOptions, progress: Progress | None = None) -> Prepared:
    """The tensors, header metadata and config.json of one export, all in memory."""
    tensors, manifest = load_tensors(store, run, step, prefix=options.key.rstrip(".") + ".", progress=progress)
    arch, model_config = _structure(dict(manifest.metadata))
    where = f"run {run!r} step {step}"
    source = f"the {arch.name} architecture" if arch.name else "the run's recorded tied_weights"
    tensors, tied = write_once(tensors, arch.shared, source)
    config = dict(model_config) if model_config is not None else None
    extra: dict[str, str] = {TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {}
    if options.dtype == "int8":
        if arch.name:  # only what compressed-tensors (and so transformers) can load: nn.Linear
            names = sorted(n for n in arch.linear_weights if n in tensors and tensors[n].is_floating_point())
        else:
            names = sorted(
                n
                for n, t in tensors.items()
                if (n == "weight" or n.endswith(".weight")) and t.is_floating_point() and t.dim() >= 2
            )
        if not names:
            covered = (
                f"the weights of {arch.name}'s nn.Linear layers not tied to another tensor, and it has none "
                "(GPT-2's projections, for one, are transformers Conv1D layers, which compressed-tensors, the "
                "format transformers loads int8 through, cannot hold)"
                if arch.name
                else "floating-point '*.weight' tensors of 2+ dimensions not tied to another tensor"
            )
            raise CkptflowError(f"int8 export of {where}: no weight to quantize: int8 covers {covered}; export bf16")
        tensors = quantize_weights(tensors, names)
        qconfig = quantization_config(arch.linear_modules - {n[: -len(".weight")] for n in names})
        extra["ckptflow.quantization"] = json.dumps(qconfig, sort_keys=True)
        if config is not None:
            config["quantization_config"] = qconfig
    elif options.dtype:
        tensors = convert_dtype(tensors, options.dtype, allow_fp16_overflow=options.allow_fp16_overflow, where=where)
        if config is not None:
            config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = _CONFIG_DTYPES[
                options.dtype
            ]
    metadata = lineage_metadata(run, step, manifest.digest, options.key, **extra)
    return Prepared(tensors, metadata, config, arch.name, manifest)


def _check_out(out: str, as_dir: bool) -> None:
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CkptflowError(f"output directory {parent} does not exist; create it first")
    if as_dir and os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CkptflowError(
            f"{out} already exists and is not an empty directory; a model directory is written whole: "
            "choose a new path or remove it"
        )


def write_model_dir(out: str, prepared: Prepared, lineage: Lineage, options: ExportOptions) -> list[str]:
    """Write the directory under a temporary name, then rename it into place: a reader
    never sees half a model. Returns the file names."""
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    os.mkdir(tmp)
    try:
        files = write_weights(prepared.tensors, tmp, prepared.metadata, options.max_shard_bytes)
        if prepared.config is not None:
            write_json(prepared.config, os.path.join(tmp, CONFIG))
            files.append(CONFIG)
        export = {**options.to_json(), **({"int8_error": ERROR_BOUND} if options.dtype == "int8" else {})}
        card = render(lineage, export=export, tensors=len(prepared.tensors), architecture=prepared.architecture)
        with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
            f.write(card)
        files.append(CARD)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked before): the rename replaces it
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(files)


def export_safetensors(
    store: Store | str,
    run: str,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    options: ExportOptions | None = None,
    lineage: Lineage | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``options.key``'s tensors of one checkpoint to ``out`` (a ``.safetensors``
    file, or otherwise a model directory).

    ``step=None`` picks the newest checkpoint that verifies completely (the whole
    checkpoint, not only the exported tensors: a partly corrupt checkpoint is suspect);
    only damage moves it to an older one (``newest_verified_step``).
    ``lineage`` fills the model card (default: the checkpoint's name, digest and kind).
    """
    store = open_store(store)
    options = options or ExportOptions()
    fmt.validate_run(run)
    out = os.path.abspath(os.fspath(out))
    as_dir = not out.endswith(".safetensors")
    _check_out(out, as_dir)
    skipped: list[tuple[int, str]] = []
    if step is None:
        step, skipped = newest_verified_step(store, run, progress)
    prepared = prepare(store, run, step, options, progress)
    digest = prepared.manifest.digest
    if as_dir:
        files = write_model_dir(out, prepared, lineage or Lineage.of(prepared.manifest), options)
    else:
        write_safetensors(prepared.tensors, out, prepared.metadata)
        files = [os.path.basename(out)]
    nbytes_written = sum(nbytes(t) for t in prepared.tensors.values())
    return ExportResult(run, step, out, len(prepared.tensors), nbytes_written, digest, tuple(files), skipped)
