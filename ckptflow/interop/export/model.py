"""Export one checkpoint's model weights: a safetensors file, or a model directory that
``transformers`` loads with ``from_pretrained``.

``--out x.safetensors`` writes one new file. Any other ``--out`` is a new directory in the
Hugging Face layout: ``model.safetensors`` (past ``max_shard_bytes``, shards and
``model.safetensors.index.json``), ``config.json`` when the run recorded its model config
(``ck.save(step, state, metadata=model_metadata(model))``) or one is given
(``model_config``, ``--config``), and a ``README.md`` model card with the lineage. Tied
tensors are written once; fp16 refuses values it cannot hold; int8 is a format a loader
dequantizes or refuses (``quantize``), and is written only into a directory whose
config.json declares it. The same checkpoint and options always give the same bytes, so
a deleted model version can be rebuilt and checked against its recorded hashes.

A lossy archive copy is exported only with ``allow_lossy`` and a commit whose validation
failed only with ``allow_failed`` (``tensors.admit``); every file then says so.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.interop.export.architecture import Architecture, check_fits, drop_unsaved, structure
from ckptflow.interop.export.card import Lineage, render
from ckptflow.interop.export.files import (
    DISK,
    FAILED_CONFIG_KEY,
    FAILED_KEY,
    LOSSY_CONFIG_KEY,
    LOSSY_KEY,
    TIED_KEY,
    lineage_metadata,
    nbytes,
    write_json,
    write_safetensors,
    write_text,
    write_weights,
)
from ckptflow.interop.export.options import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES
from ckptflow.interop.export.quantize import ERROR_BOUND, quantization_config, quantize_weights
from ckptflow.interop.export.tensors import (
    Admitted,
    Progress,
    admit,
    convert_dtype,
    load_tensors,
    newest_verified_step,
    write_once,
)
from ckptflow.store import Store, open_store

CONFIG, CARD = "config.json", "README.md"
UNSAVED_KEY = "ckptflow.unsaved"  # header metadata: buffers in the checkpoint the model does not save, left out
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


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    run: str
    step: int
    path: str  # the file, or the model directory
    tensors: int
    bytes: int  # tensor bytes written, after any conversion
    digest: str  # the source manifest's digest, also in every file's metadata
    files: tuple[str, ...] = ()  # names in the directory (a file export: its own name)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer steps passed over: each proved damaged
    lossy: dict[str, Any] | None = None  # exported from a lossy copy (allow_lossy): its ``lossy`` record
    failed_validation: dict[str, Any] | None = None  # exported despite this failed verdict (allow_failed)


@dataclass(frozen=True, kw_only=True)
class Prepared:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    config: dict[str, Any] | None  # config.json
    architecture: str
    manifest: Manifest
    lossy: dict[str, Any] | None


def _int8_names(arch: Architecture, tensors: dict[str, torch.Tensor], where: str) -> list[str]:
    """The weights an int8 export quantizes: the nn.Linear weights, all that compressed-tensors
    (the format transformers loads int8 through) can hold."""
    names = sorted(n for n in arch.linear_weights if n in tensors and tensors[n].is_floating_point())
    if not names:
        raise CkptflowError(
            f"int8 export of {where}: no weight to quantize: int8 covers the weights of {arch.name}'s nn.Linear "
            "layers not tied to another tensor, and it has none (GPT-2's projections, for one, are transformers "
            "Conv1D layers, which compressed-tensors, the format transformers loads int8 through, cannot hold); "
            "export bf16"
        )
    return names


def _int8_needs_config(where: str) -> CkptflowError:
    return CkptflowError(
        f"int8 export of {where}: the checkpoint records no model config, so the export would have no config.json "
        "declaring its quantization, and the model's ordinary config.json put beside it would load the int8 codes "
        "as float weights without an error. Pass the model's config.json (--config path/to/config.json; library: "
        "model_config=json.load(open(path))), or record ckptflow.model_metadata(model) in the metadata of "
        "its saves; or export bf16"
    )


def prepare(
    store: Store,
    admitted: Admitted,
    options: ExportOptions,
    progress: Progress | None = None,
    *,
    model_config: Mapping[str, Any] | None = None,
) -> Prepared:
    """The tensors, header metadata and config.json of one export, all in memory."""
    run, step = admitted.manifest.run, admitted.manifest.step
    where = f"run {run!r} step {step}"
    arch, config = structure(admitted.manifest, options.key, model_config)
    if options.dtype == "int8" and config is None:
        raise _int8_needs_config(where)
    tensors, manifest = load_tensors(store, run, step, prefix=options.key.rstrip(".") + ".", progress=progress)
    admitted.check_same(manifest)
    tensors, unsaved = drop_unsaved(arch, tensors)
    source = f"the {arch.name} architecture" if arch.name else "the tie groups recorded at save time"
    tensors, tied = write_once(tensors, arch.shared, source)
    if config is not None:  # given, or recorded by the run (for the entry it saved it with)
        check_fits(arch, tensors, where, recorded_for=None if model_config is not None else options.key)
    extra: dict[str, str] = {TIED_KEY: json.dumps(tied, sort_keys=True)} if tied else {}
    if unsaved:
        extra[UNSAVED_KEY] = json.dumps(unsaved)
    if options.dtype == "int8":
        assert config is not None  # refused above, before any tensor was read
        names = _int8_names(arch, tensors, where)
        tensors = quantize_weights(tensors, names, where=where)
        config["quantization_config"] = quantization_config(arch.linear_modules - {n[: -len(".weight")] for n in names})
        extra["ckptflow.quantization"] = json.dumps(config["quantization_config"], sort_keys=True)
    elif options.dtype:
        tensors = convert_dtype(tensors, options.dtype, allow_fp16_overflow=options.allow_fp16_overflow, where=where)
        if config is not None:
            config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = _CONFIG_DTYPES[
                options.dtype
            ]
    if admitted.lossy is not None:
        extra[LOSSY_KEY] = json.dumps(admitted.lossy, sort_keys=True)
        if config is not None:
            config[LOSSY_CONFIG_KEY] = admitted.lossy
    if admitted.failed_validation is not None:
        extra[FAILED_KEY] = json.dumps(admitted.failed_validation, sort_keys=True)
        if config is not None:
            config[FAILED_CONFIG_KEY] = admitted.failed_validation
    metadata = lineage_metadata(run, step, manifest.digest, options.key, **extra)
    return Prepared(
        tensors=tensors,
        metadata=metadata,
        config=config,
        architecture=arch.name,
        manifest=manifest,
        lossy=admitted.lossy,
    )


def _check_out(out: str, *, as_dir: bool) -> None:
    """Refuse, before any tensor is read, an output path the export would have to replace
    or could not rename into: an export creates its file or directory and never replaces
    one (an existing model file may be the one deployed), and a symbolic link would be
    replaced by the rename (a file) or make it fail once all the work is done (a directory)."""
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CkptflowError(f"output directory {parent} does not exist; create it first")
    if os.path.islink(out):
        raise CkptflowError(
            f"{out} is a symbolic link; an export writes a new file or directory in its place rather than "
            "follow or replace a link: pass the path it points to (if that is new or an empty directory) or a new path"
        )
    if not as_dir and os.path.exists(out):
        raise CkptflowError(
            f"{out} already exists; an export never replaces a file (it may be a model in use): choose a new path "
            "or remove it"
        )
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
        card = render(
            lineage,
            export=export,
            tensors=len(prepared.tensors),
            architecture=prepared.architecture,
            lossy=prepared.lossy,
        )
        write_text(os.path.join(tmp, CARD), card)
        files.append(CARD)
        DISK.fsync_dir(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked before): the rename replaces it
        os.rename(tmp, out)
        DISK.fsync_dir(os.path.dirname(os.path.abspath(out)))
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
    model_config: Mapping[str, Any] | None = None,
    allow_lossy: bool = False,
    allow_failed: bool = False,
) -> ExportResult:
    """Export ``options.key``'s tensors of one checkpoint to ``out`` (a ``.safetensors``
    file, or otherwise a model directory).

    ``step=None`` picks the newest checkpoint that verifies completely (the whole
    checkpoint, not only the exported tensors: a partly corrupt checkpoint is suspect);
    only damage moves it to an older one (``newest_verified_step``).
    ``lineage`` fills the model card (default: the checkpoint's name, digest and kind).
    ``model_config``: the model's transformers config (its config.json as a dict), for a
    checkpoint that did not record one; it must describe the tensors saved.
    ``allow_lossy`` exports a lossy archive copy, ``allow_failed`` a commit whose validation
    verdict is failed; both are refused otherwise, and marked in the files when allowed.
    ``progress`` is called with the bytes of the saved tensors read for the files (what they
    hold, unless ``dtype`` narrows them), not those the verification of ``step=None`` reads.
    """
    store = open_store(store)
    options = options or ExportOptions()
    fmt.validate_run(run)
    out = os.path.abspath(os.fspath(out))
    as_dir = not out.endswith(".safetensors")
    _check_out(out, as_dir=as_dir)
    if options.dtype == "int8" and not as_dir:
        raise CkptflowError(
            f"int8 export to the single file {out} refused: int8 weights load right only beside a config.json "
            "that declares their quantization, which a model directory holds and a file cannot. Pass --out DIR"
        )
    skipped: list[tuple[int, str]] = []
    if step is None:
        step, skipped = newest_verified_step(store, run)
    admitted = admit(store, run, step, allow_lossy=allow_lossy, allow_failed=allow_failed)
    prepared = prepare(store, admitted, options, progress, model_config=model_config)
    if as_dir:
        lineage = lineage or Lineage.of(prepared.manifest)
        if admitted.failed_validation is not None and not lineage.validation:
            lineage = replace(lineage, validation={"ok": False, **admitted.failed_validation})
        files = write_model_dir(out, prepared, lineage, options)
    else:
        write_safetensors(prepared.tensors, out, prepared.metadata)
        files = [os.path.basename(out)]
    nbytes_written = sum(nbytes(t) for t in prepared.tensors.values())
    return ExportResult(
        run=run,
        step=step,
        path=out,
        tensors=len(prepared.tensors),
        bytes=nbytes_written,
        digest=prepared.manifest.digest,
        files=tuple(files),
        skipped=skipped,
        lossy=admitted.lossy,
        failed_validation=admitted.failed_validation,
    )
