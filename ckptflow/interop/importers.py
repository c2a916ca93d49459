"""Bring checkpoints written by other tools into a store, without unpickling anything.

``import_checkpoint(root, run, step, src)`` reads ``src`` and commits it through
``Checkpointer.save``: a normal checkpoint (manifest, verified chunks) that restores,
exports and goes through the lifecycle like any other. What it becomes:

========================  ====================================================  ============================
source                    state of the new checkpoint                           metadata
========================  ====================================================  ============================
DCP directory             the state given to ``dcp.save``, nested as it was     a ckptflow DCP export's own
(``.metadata``)           (``ckptflow.interop.dcp_dir``: no pickle runs)                (its ``ckptflow.json``)
safetensors file          ``{"model": {name: tensor}}``                         -
Hugging Face model dir    ``{"model": the model's state dict}``: tied names     ``model_config``: config.json
                          (dropped by ``save_pretrained``) back, from the       (``ckptflow export`` writes
                          architecture config.json names; buffers it does not   it back)
                          save left out (``drop_unsaved``)
``torch.save`` file       ``torch.load(weights_only=True)``: a dict of tensors  -
(.pt .pth .bin .ckpt)     becomes ``{"model": it}``, any other dict the state
========================  ====================================================  ============================

A ``torch.save`` file must be in the zip format with its entries stored, as torch.save
writes them (``ckptflow.interop.torch_files``): ``torch.load`` trusts the sizes in it.
Every import records ``metadata["import"] = {"format", "source"}``, and ``"unsaved"``: the
buffers a model directory's files hold that its config's model does not save (BERT's
``embeddings.position_ids``, written by older transformers), left out by the rule an export
follows (``architecture.drop_unsaved``), so the checkpoint is the model's ``state_dict()``
and restores strictly into a freshly built model. No RNG state is stored:
the importing process's RNG is not the run's. An export of a lossy archive copy carries
its ``lossy`` record (a DCP export's ``ckptflow.json``, a safetensors header): the import
commits it again (``carried_lossy``), so the new checkpoint restores only with ``allow_lossy``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ckptflow.catalog.verdicts import Subject, carried_failure, describe_verdict, write_record
from ckptflow.dcp.collectives import Group
from ckptflow.dcp.writer import Progress
from ckptflow.errors import CkptflowError, FailedValidationError, UnsupportedStateError
from ckptflow.format import layout as fmt
from ckptflow.interop.carried import carried_failed_validation, carried_lossy
from ckptflow.interop.dcp_dir import read_state
from ckptflow.interop.dcp_metadata_file import METADATA_FILE
from ckptflow.interop.export.architecture import drop_unsaved, from_transformers_config
from ckptflow.interop.export.dcp import SIDECAR
from ckptflow.interop.export.files import INDEX, TIED_KEY, WEIGHTS, weight_files
from ckptflow.interop.source_files import MAX_JSON_BYTES, check_name_count, check_regular_file, read_json_file
from ckptflow.interop.state_checks import check_state
from ckptflow.interop.torch_files import check_plain_zip, weights_only_refusal
from ckptflow.store import Store
from ckptflow.training.checkpointer import Checkpointer, SaveResult
from ckptflow.training.save_preflight import flatten_on_every_rank

FORMATS = fmt.IMPORT_FORMATS
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    run: str
    step: int
    format: str
    source: str
    entries: list[str]  # top-level entries of the new checkpoint's state
    tensors: int
    bytes: int  # tensor bytes
    digest: str  # the new manifest's digest
    lossy: dict | None = None  # the source was exported from a lossy archive copy: its ``lossy`` record
    unsaved: list[str] = field(default_factory=list)  # buffers left out: the source's config's model does not save them
    failed_validation: dict | None = None  # the failed verdict the source was exported despite (allow_failed)


@dataclass(frozen=True, kw_only=True)
class Source:
    """What ``read_source`` read of a checkpoint written by another tool."""

    format: str
    state: dict[str, Any]
    metadata: dict[str, Any]  # what the source says of itself: a DCP export's metadata, a model's config
    unsaved: list[str] = field(default_factory=list)  # buffers its config's model does not save: left out


def detect_format(src: str) -> str:
    """Which of ``FORMATS`` ``src`` is, from what it holds; an error naming them otherwise."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, METADATA_FILE)):
            return "dcp"
        if any(os.path.isfile(os.path.join(src, f)) for f in (WEIGHTS, INDEX)):
            return "hf"
    elif os.path.isfile(src):
        if src.endswith(".safetensors"):
            return "safetensors"
        if src.endswith(TORCH_SUFFIXES):
            return "torch"
    elif not os.path.exists(src):
        raise CkptflowError(f"{src} does not exist")
    raise CkptflowError(
        f"{src} is none of what ckptflow imports: a DCP checkpoint directory (with {METADATA_FILE}), a "
        f"Hugging Face model directory ({WEIGHTS} or {INDEX}), a .safetensors file, or a torch.save file "
        f"({', '.join(TORCH_SUFFIXES)}); pass --format if the name misleads"
    )


TENSOR_SLACK = 256  # a model directory's config may build this many more tensors than twice the files hold


def _read_json(path: str) -> Any:
    return read_json_file(path, limit=MAX_JSON_BYTES)


def _from_dcp(src: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    state = read_state(src)
    sidecar = os.path.join(src, SIDECAR)
    metadata: dict[str, Any] = {}
    if os.path.isfile(sidecar):
        doc = _read_json(sidecar)
        if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
            metadata = dict(doc["metadata"])
    return state, metadata, []


def _read_safetensors(paths: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of ``paths`` as stored (no dtype change), plus the names a ckptflow
    export wrote once for several tied ones (its ``ckptflow.tied`` header)."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    named = 0
    for path in paths:
        check_regular_file(path)
        try:
            with safe_open(path, "pt") as f:
                names = f.keys()
                named += len(names)
                check_name_count(named, path if len(paths) == 1 else f"{path} (with the files before it)")
                for name in names:
                    if name in tensors:
                        raise CkptflowError(f"tensor {name!r} is stored twice (again in {path})")
                    tensors[name] = f.get_tensor(name)
                header_tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
                if isinstance(header_tied, dict):
                    tied.update({k: v for k, v in header_tied.items() if isinstance(v, str)})
        except (OSError, ValueError, RecursionError, SafetensorError) as e:
            raise CkptflowError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not tensors:  # as a torch.save file of an empty dict is refused
        raise CkptflowError(f"{', '.join(paths)} hold(s) no tensors: nothing to import")
    for dropped, kept in tied.items():
        if kept in tensors and dropped not in tensors:
            tensors[dropped] = tensors[kept]
    return tensors


def _from_safetensors(src: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    return {"model": _read_safetensors([src])}, {}, []


def _from_hf(src: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The model's state dict as its config's architecture has it: tied names back, and the
    buffers it does not save left out (``drop_unsaved``, the names returned). A config that
    declares a quantization is refused: the files hold codes, not the model's weights."""
    config_path = os.path.join(src, "config.json")
    has_config = os.path.isfile(config_path)
    config = _read_json(config_path) if has_config else {}
    if not isinstance(config, dict):
        raise CkptflowError(f"{config_path} is not a JSON object")
    if config.get("quantization_config") is not None:
        declared = config["quantization_config"]
        method = declared.get("quant_method") if isinstance(declared, dict) else None
        raise CkptflowError(
            f"{config_path} declares quantization_config ({method or repr(declared)[:200]}): its weights are quantized "
            "codes, not the values trained, and a checkpoint restores what it holds as the model's weights; "
            "refused before reading them. Import the checkpoint it was exported from, or dequantize it first "
            "(for a ckptflow int8 export: ckptflow.interop.export.load_exported(DIR), saved as a safetensors file)"
        )
    files, listed = weight_files(src)
    tensors = _read_safetensors(files)
    if listed - set(tensors):
        raise CkptflowError(f"{src}: tensors listed in {INDEX} are missing: {sorted(listed - set(tensors))[:8]}")
    if not has_config:
        return {"model": tensors}, {}, []
    unsaved: list[str] = []
    if config.get("architectures"):
        arch = from_transformers_config(config, max_tensors=2 * len(tensors) + TENSOR_SLACK)
        for group in arch.shared:
            present = [n for n in group if n in tensors]
            for name in group:
                if present and name not in tensors:  # one tensor, as in the model's state_dict()
                    tensors[name] = tensors[present[0]]
        tensors, unsaved = drop_unsaved(arch, tensors)
    return {"model": tensors}, {"model_config": config}, unsaved


def _from_torch(src: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    check_plain_zip(src, src)  # before torch.load trusts a size in it (ckptflow.interop.torch_files)
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = weights_only_refusal(e)
        raise CkptflowError(
            f"{src} holds pickled objects that torch.load(weights_only=True) refuses ({first}); ckptflow never "
            "unpickles anything else, since that can run code. Save tensors and plain values only "
            "(torch.save(model.state_dict(), ...)), or safetensors"
        ) from None
    except Exception as e:  # whatever torch.load raises on bytes it cannot read: they are not a torch.save file
        raise CkptflowError(f"{src} is not a readable torch.save file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, Mapping):
        raise CkptflowError(
            f"{src} holds a {type(obj).__name__}; ckptflow imports a dict (a state dict, or a dict of entries)"
        )
    if not obj:
        raise CkptflowError(f"{src} holds an empty dict: nothing to import")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": dict(obj)}, {}, []
    if not all(isinstance(k, str) and k for k in obj):
        raise CkptflowError(f"{src}: the top-level keys of a state must be non-empty strings, got {list(obj)[:8]}")
    return dict(obj), {}, []


_READERS = {"dcp": _from_dcp, "safetensors": _from_safetensors, "hf": _from_hf, "torch": _from_torch}


def read_source(src: str | os.PathLike, format: str = "auto") -> Source:
    """``src``'s state and what it says of itself, read without unpickling anything."""
    src = os.path.abspath(os.fspath(src))
    chosen = detect_format(src) if format == "auto" else format
    if chosen not in _READERS:
        raise CkptflowError(f"import format {format!r} is not one of {('auto', *FORMATS)}")
    state, metadata, unsaved = _READERS[chosen](src)
    check_state(src, state)
    return Source(format=chosen, state=state, metadata=metadata, unsaved=unsaved)


def import_checkpoint(
    root: str | Store,
    run: str,
    step: int,
    src: str | os.PathLike,
    *,
    format: str = "auto",
    metadata: dict[str, Any] | None = None,
    chunk_bytes: int = 8 << 20,
    codec: str = "raw",
    allow_failed: bool = False,
    progress: Progress | None = None,
) -> ImportResult:
    """Commit ``src`` as checkpoint ``step`` of ``run`` in ``root`` (a full save: every
    chunk written). The step must be free. ``metadata`` adds to what the source gives.

    An export made despite a failed validation (it carries the verdict) is refused unless
    ``allow_failed``; then the verdict goes into the new commit's metadata
    (``import.failed_validation``) and becomes its validation verdict, failed, so export and
    promotion refuse it and selection passes it over; validating it again keeps it
    (``carried_failure``): it is cleared at the source, validated again and exported anew.

    ``progress`` is told the bytes of each chunk written (a large import takes a while)."""
    fmt.validate_run(run)
    fmt.validate_step(step)
    source = os.path.abspath(os.fspath(src))
    chosen = detect_format(source) if format == "auto" else format
    failed = carried_failed_validation(source, chosen)  # before a tensor is read
    if failed is not None and not allow_failed:
        when, problems = describe_verdict(failed)
        raise FailedValidationError(
            f"{source} was exported despite a failed validation verdict (recorded {when}: {problems}); importing it "
            "as a clean checkpoint would let it pass for a validated model. Refused: import another export, or "
            "pass --allow-failed (allow_failed=True) to import it with the verdict, which keeps it refused by "
            "export and promotion (validating it again keeps it)"
        )
    lossy = carried_lossy(source, chosen)
    read = read_source(source, chosen)
    state = read.state
    record: dict[str, Any] = {"format": chosen, "source": source, **({"unsaved": read.unsaved} if read.unsaved else {})}
    if failed is not None:
        record["failed_validation"] = failed
    meta = {**read.metadata, **(metadata or {}), "import": record}
    with _refused_as_import(source, chosen):  # the save's own refusal, before the store is opened (or created)
        flatten_on_every_rank(state, meta, Group(local=True))
    with Checkpointer(root, run=run, chunk_bytes=chunk_bytes, codec=codec, local=True, progress=progress) as ck:
        with _refused_as_import(source, chosen):
            saved = ck.save(step, state, metadata=meta, kind="full", rng=False, lossy=lossy)
        assert isinstance(saved, SaveResult) and saved.info is not None  # blocking, and its own coordinator
        info = saved.info
        if failed is not None:
            _record_carried_verdict(ck.store, Subject(run, step, info.digest), meta, failed)
    return ImportResult(
        run=run,
        step=step,
        format=chosen,
        source=source,
        entries=list(state),
        tensors=_count_tensors(state),
        bytes=info.logical_bytes,
        digest=info.digest,
        lossy=lossy,
        unsaved=read.unsaved,
        failed_validation=failed,
    )


@contextlib.contextmanager
def _refused_as_import(source: str, chosen: str) -> Iterator[None]:
    """A state the save refuses, said as the import of ``source`` it is."""
    try:
        yield
    except UnsupportedStateError as e:
        raise UnsupportedStateError(f"importing {source} ({chosen}): {e}") from None


def _record_carried_verdict(store: Store, subject: Subject, metadata: dict, failed: dict) -> None:
    """The new commit's validation verdict: failed, as the one its source was exported despite
    (``carried_failure``, which validating it again keeps), so nothing takes it before it is
    validated."""
    write_record(
        store, subject, "validation", {"ok": False, "problems": [carried_failure(metadata)], "imported": failed}
    )


def _count_tensors(tree: Any) -> int:
    stack, count = [tree], 0
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            count += 1
        elif isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return count
