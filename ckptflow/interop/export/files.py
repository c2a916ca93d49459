"""safetensors files written deterministically, one file or sharded the way transformers shards.

The ``safetensors`` package writes its header from a hash map, so two exports of the
same tensors differ in header byte order (and hash). A model version must be
rebuildable to the same bytes, so the few lines of the format are written here: the
8-byte header length, the header JSON with sorted keys (padded with spaces to 8 bytes),
then every tensor's bytes in name order, streamed to the file one tensor at a time.
Readers (``safetensors``, transformers) accept any order.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import uuid
from collections.abc import Mapping

import torch
from safetensors import safe_open

from ckptflow.errors import CkptflowError
from ckptflow.interop.export.quantize import dequantize_weights
from ckptflow.store.disk import Disk

DISK = Disk()  # the local store's durable file calls: write, fsync, fsync the directory

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TIED_KEY = "ckptflow.tied"  # header metadata: {dropped name: kept name} for tensors written once
LOSSY_KEY = "ckptflow.chunks.lossy"  # header metadata: the lossy copy's ``lossy`` record (JSON) it was exported from
LOSSY_CONFIG_KEY = "ckptflow_lossy"  # config.json: the same record (transformers' save_pretrained keeps it)
FAILED_KEY = "ckptflow.failed_validation"  # header metadata: the failed verdict it was exported despite (JSON)
FAILED_CONFIG_KEY = "ckptflow_failed_validation"  # config.json: the same verdict (save_pretrained keeps it)

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",  # a rotary embedding's freqs_cis buffer, for one
}  # every dtype the safetensors format (0.8) names


def lineage_metadata(run: str, step: int, digest: str, key: str, **extra: str) -> dict[str, str]:
    """safetensors header metadata naming the exact checkpoint a file came from."""
    return {
        "format": "pt",  # what transformers' loaders expect of a PyTorch safetensors file
        "ckptflow.run": run,
        "ckptflow.step": str(step),
        "ckptflow.manifest_digest": digest,
        "ckptflow.key": key,
        **extra,
    }


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(tensors: Mapping[str, torch.Tensor], out: str | os.PathLike, metadata: Mapping[str, str]) -> int:
    """Write one safetensors file atomically (temp file, fsync, rename) and
    deterministically. Returns the tensor bytes written."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPE_NAMES:
            raise CkptflowError(
                f"tensor {name!r} has dtype {t.dtype}, which the safetensors format cannot hold: save it as one it "
                "can (a complex128 buffer as torch.view_as_real(t)), or export the state with --format dcp"
            )
        end = offset + nbytes(t)
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(out)}.tmp-{uuid.uuid4().hex}"
    try:
        data = (
            tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().data for name in sorted(tensors)
        )
        DISK.write_new(tmp, itertools.chain((struct.pack("<Q", len(blob)), blob), data))
        _publish(tmp, os.fspath(out))
        DISK.fsync_dir(os.path.dirname(os.path.abspath(out)))  # the new name survives a crash too
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return offset


def _publish(tmp: str, out: str) -> None:
    """Give the finished file ``tmp`` the name ``out``, never replacing a file there: a hard
    link fails if ``out`` exists, even one made since the export checked (a rename would
    replace it). On a filesystem without hard links, a rename after one more check."""
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise CkptflowError(
            f"{out} appeared while the export was being written; an export never replaces a file: choose a new path"
        ) from None
    except OSError:  # no hard links here (EPERM, ENOTSUP): the check, then the rename
        if os.path.lexists(out):
            raise CkptflowError(f"{out} already exists; an export never replaces a file: choose a new path") from None
        os.rename(tmp, out)


def shard_names(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in name order: a shard closes before the tensor that would
    take it past ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + nbytes(tensors[name]) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(tensors[name])
    return shards


def write_weights(
    tensors: Mapping[str, torch.Tensor], directory: str, metadata: Mapping[str, str], max_shard_bytes: int
) -> list[str]:
    """``model.safetensors``, or past ``max_shard_bytes`` ``model-0000i-of-0000n.safetensors``
    plus ``model.safetensors.index.json`` (transformers' names and index). Returns the
    file names written."""
    shards = shard_names(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(tensors, os.path.join(directory, WEIGHTS), metadata)
        return [WEIGHTS]
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors({n: tensors[n] for n in names}, os.path.join(directory, file), metadata)
        weight_map.update(dict.fromkeys(names, file))
        files.append(file)
    index = {"metadata": {"total_size": sum(nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    write_json(index, os.path.join(directory, INDEX))
    return [*files, INDEX]


def write_json(doc: object, path: str) -> None:
    write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def write_text(path: str, text: str) -> None:
    """A new file of an export, fsynced: a model directory is renamed into place only once
    all it holds is on disk, or a crash after the rename could leave a config.json or an
    index empty beside its weights."""
    DISK.write_new(path, [text.encode("utf-8")])


MAX_INDEX_BYTES = 64 << 20  # an index of a million tensor names is a few tens of MB


def weight_files(directory: str) -> tuple[list[str], set[str]]:
    """A model directory's safetensors files and the tensor names its index lists (none
    for ``model.safetensors``): the one reader of a model directory, for the importer and
    ``load_exported`` alike, so both read the weights transformers' ``from_pretrained``
    reads: ``model.safetensors`` where there is one, even beside an index (a directory
    holding both, as one left by an earlier save of another size can, has two sets of
    weights, and transformers takes the file), else its index's files. An index is
    refused read unbounded, without a ``weight_map`` of names to files, or naming a file
    outside the directory."""
    weights, index = os.path.join(directory, WEIGHTS), os.path.join(directory, INDEX)
    if os.path.isfile(weights) or not os.path.isfile(index):
        return [weights], set()
    if os.path.getsize(index) > MAX_INDEX_BYTES:
        raise CkptflowError(f"{index} is larger than {MAX_INDEX_BYTES} bytes; refused unread")
    try:
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CkptflowError(f"{index} is not valid JSON ({type(e).__name__}: {e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CkptflowError(f"{index} has no weight_map of tensor names to files")
    files = sorted(set(weight_map.values()))
    outside = [f for f in files if os.path.basename(f) != f or f in (".", "..")]
    if outside:
        raise CkptflowError(f"{index} names files outside the directory: {outside[:4]}")
    return [os.path.join(directory, f) for f in files], set(weight_map)


def load_exported(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """ckptflow's loader for what ``export_safetensors`` wrote (a file or a model
    directory, sharded or not): a plain state dict. int8 weights come back dequantized
    (float32), and every tied name dropped at export is back, sharing its tensor, so
    ``model.load_state_dict(load_exported(path))`` is strict-clean."""
    path = os.fspath(path)
    paths = weight_files(path)[0] if os.path.isdir(path) else [path]
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for file in paths:
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
            tied.update(json.loads((f.metadata() or {}).get(TIED_KEY, "{}")))
    tensors = dequantize_weights(tensors)
    return {**tensors, **{dropped: tensors[kept] for dropped, kept in tied.items()}}
