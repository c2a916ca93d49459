"""Plain torch.distributed.checkpoint directories, read without running anyone's code.

A directory written by ``dcp.save(state, storage_writer=FileSystemWriter(dir))`` holds a
``.metadata`` file (a pickle of DCP's ``Metadata``) and ``*.distcp`` files, each a run
of items: tensors written with ``torch.save``, and non-tensor values (BYTE_IO items)
pickled with ``torch.save``. DCP's own ``FileSystemReader`` unpickles ``.metadata`` with
``pickle.load`` and its default planner loads BYTE_IO items with
``torch.load`` with weights-only mode off: a crafted directory runs code on whoever loads it.
torch 2.13 has no safe mode for either, so this module reads them itself:

- ``.metadata`` through an unpickler that resolves only DCP's metadata classes
  (``dcp_metadata_file``);
- tensors and BYTE_IO items with ``torch.load(weights_only=True)`` only, which refuses
  any pickled object that is not plain data;
- items only from plain file names inside the directory;
- nothing read or allocated before every tensor's pieces are proved to tile it exactly
  and every item to fit in its file (``_check_items``), so a crafted ``.metadata`` can
  neither import uninitialised memory nor make the reader allocate what the files
  cannot hold; items that are not ``torch.save``'s uncompressed zip are refused unloaded
  (``torch_files.check_plain_zip``, the check a ``.pt`` import makes too).

The state comes back nested as it was saved (``Metadata.planner_data`` holds each
flattened name's path): a string in a path is a dict key, an integer a list index.
DCP stringifies dict keys, so an optimizer's raw ``state_dict()`` comes back with
``"0"`` for parameter 0.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptflow.errors import DcpFormatError
from ckptflow.format.tiling import tiling_problem
from ckptflow.interop.dcp_metadata_file import IF_TRUSTED, METADATA_FILE, read_metadata
from ckptflow.interop.pickle_walk import PickleBudget
from ckptflow.interop.source_files import check_regular_file
from ckptflow.interop.torch_files import check_plain_zip, weights_only_refusal

_PENDING = object()  # a value not read yet


def _piece_offsets(index: dcp_metadata.MetadataIndex, item: dcp_metadata.TensorStorageMetadata) -> tuple[int, ...]:
    return tuple(index.offset) if index.offset is not None else (0,) * len(item.size)


def _check_items(md: dcp_metadata.Metadata, directory: str) -> dict[str, dict[tuple[int, ...], tuple[int, ...]]]:
    """Each tensor's pieces (offsets -> sizes), once proved to tile it exactly, each
    non-empty one with an item that can hold it; and every item's bytes inside its file
    and no other item's. So the files hold every byte a tensor declares.

    Empty pieces hold no bytes and may lack an item: the empty shards of a DTensor (a
    tensor with fewer rows than ranks) all start at its end, and DCP keeps one item."""
    where = f"DCP metadata {os.path.join(directory, METADATA_FILE)}"
    pieces: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    itemless: dict[str, set[tuple[int, ...]]] = {}  # non-empty pieces no item has claimed yet
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            continue
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
        problem = tiling_problem(tuple(item.size), boxes)
        if problem:
            raise DcpFormatError(
                f"{where}: tensor {fqn!r} of shape {list(item.size)}: {problem}. Its pieces must cover it exactly "
                "(importing it would leave elements unwritten or written twice); the metadata is damaged or was "
                "not written by DCP"
            )
        pieces[fqn] = dict(sorted(boxes, key=lambda box: math.prod(box[1]) > 0))  # a non-empty piece wins its offset
        itemless[fqn] = {offsets for offsets, sizes in boxes if math.prod(sizes)}
    file_sizes: dict[str, int] = {}
    spans: list[tuple[str, int, int, str]] = []  # file, start, end, fqn
    for index, info in md.storage_data.items():
        path = os.path.join(directory, info.relative_path)
        if info.relative_path not in file_sizes:
            try:
                file_sizes[info.relative_path] = os.stat(path).st_size
            except OSError as e:
                raise DcpFormatError(f"cannot read {index.fqn!r} from {path}: {e}") from None
        if info.offset + info.length > file_sizes[info.relative_path]:
            raise DcpFormatError(
                f"{where}: {index.fqn!r} claims bytes {info.offset}..{info.offset + info.length} of {path}, which "
                f"has {file_sizes[info.relative_path]} bytes: the file is truncated or the metadata is damaged"
            )
        spans.append((info.relative_path, info.offset, info.offset + info.length, index.fqn))
        item = md.state_dict_metadata[index.fqn]
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            continue
        offsets = _piece_offsets(index, item)
        sizes = pieces[index.fqn].get(offsets)
        if sizes is None:
            raise DcpFormatError(
                f"{where}: an item of {index.fqn!r} is at {list(offsets)}, where none of its pieces is"
            )
        itemless[index.fqn].discard(offsets)
        needs = math.prod(sizes) * item.properties.dtype.itemsize
        if needs > info.length:
            raise DcpFormatError(
                f"{where}: the piece of {index.fqn!r} at {list(offsets)} of size {list(sizes)} needs {needs} bytes, "
                f"but its item holds {info.length}: the metadata is damaged"
            )
    for fqn, missing in itemless.items():
        if missing:
            raise DcpFormatError(
                f"{where}: tensor {fqn!r}: the piece at {list(min(missing))} has no stored item (a file or shard "
                "is missing, or the metadata is damaged)"
            )
    spans.sort()
    for (name, _, end, fqn), (next_name, start, next_end, next_fqn) in zip(spans, spans[1:]):
        if name == next_name and start < end:
            raise DcpFormatError(
                f"{where}: the items of {fqn!r} and {next_fqn!r} share bytes {start}..{min(end, next_end)} of "
                f"{os.path.join(directory, name)}; DCP writes each item to bytes of its own"
            )
    return pieces


def _item_bytes(directory: str, info: _StorageInfo, fqn: str) -> bytes:
    """The item's bytes; ``_check_items`` has bounded its length by its file's size."""
    path = os.path.join(directory, info.relative_path)
    check_regular_file(path, error=DcpFormatError)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as e:
        raise DcpFormatError(f"cannot read {fqn!r} from {path}: {e}") from None
    if len(data) != info.length:
        raise DcpFormatError(
            f"{path} ends before {fqn!r} (bytes {info.offset}..{info.offset + info.length}): the file is truncated"
        )
    return data


def _torch_load(data: bytes, what: str, budget: PickleBudget) -> Any:
    # the items together within one file's bounds
    check_plain_zip(data, what, error=DcpFormatError, budget=budget, otherwise=IF_TRUSTED)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = weights_only_refusal(e)
        raise DcpFormatError(
            f"{what} is a pickled Python object that torch.load(weights_only=True) refuses ({first}); ckptflow "
            "never unpickles anything else, since that can run code. Store such values as JSON-able data "
            f"(numbers, strings, lists, dicts) or tensors, or, {IF_TRUSTED}"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise DcpFormatError(f"{what} is not a readable torch.save item ({type(e).__name__}: {e})") from None


def read_state(directory: str) -> dict[str, Any]:
    """The state saved in a plain DCP directory: full tensors (every piece copied into
    place) and the non-tensor values, nested as they were saved.

    Before anything is read or allocated, the names and pieces are counted (``read_metadata``),
    and ``_check_items`` proves that every tensor's pieces tile it exactly, each has one item
    whose bytes lie in its file and no other item's, and the item can hold the piece; each
    piece read must then be a tensor of the declared dtype and shape. So every element
    imported was written from bytes read, and nothing larger than the directory's files is
    allocated.
    """
    directory = os.path.abspath(directory)
    md = read_metadata(directory)
    pieces = _check_items(md, directory)
    flat: dict[str, Any] = dict.fromkeys(md.state_dict_metadata, _PENDING)  # in the order the state was saved
    budget = PickleBudget()
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        what = f"{index.fqn!r} in {os.path.join(directory, info.relative_path)}"
        value = _torch_load(_item_bytes(directory, info, index.fqn), what, budget)
        item = md.state_dict_metadata[index.fqn]
        if not isinstance(item, dcp_metadata.TensorStorageMetadata):
            flat[index.fqn] = value
            continue
        offsets = _piece_offsets(index, item)
        sizes = pieces[index.fqn][offsets]
        if not isinstance(value, torch.Tensor) or value.dtype != item.properties.dtype:
            kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise DcpFormatError(f"{what} holds {kind}, not the {item.properties.dtype} piece declared")
        if tuple(value.shape) != sizes:
            raise DcpFormatError(
                f"{what} holds a tensor of shape {list(value.shape)}, not the {list(sizes)} declared at {list(offsets)}"
            )
        if sizes == tuple(item.size):  # the whole tensor in one piece: no copy
            flat[index.fqn] = value
            continue
        if not math.prod(sizes):
            continue
        if flat[index.fqn] is _PENDING:
            flat[index.fqn] = _allocate(item, index.fqn, directory)
        target = flat[index.fqn]
        for dim, (start, length) in enumerate(zip(offsets, sizes)):
            target = target.narrow(dim, start, length)
        target.copy_(value)
    for fqn, value in flat.items():
        item = md.state_dict_metadata[fqn]
        if value is _PENDING and isinstance(item, dcp_metadata.TensorStorageMetadata):
            flat[fqn] = _allocate(item, fqn, directory)  # no elements (its pieces, if any, are empty)
    unstored = [fqn for fqn, v in flat.items() if v is _PENDING]
    if unstored:
        raise DcpFormatError(f"{directory} does not store all of {unstored[:12]}: a file or shard is missing")
    return _nested(flat, md.planner_data or {})


def _allocate(item: dcp_metadata.TensorStorageMetadata, fqn: str, directory: str) -> torch.Tensor:
    try:
        return torch.empty(item.size, dtype=item.properties.dtype)
    except (RuntimeError, MemoryError) as e:
        raise DcpFormatError(
            f"tensor {fqn!r} of {directory} has shape {list(item.size)}, which cannot be allocated here "
            f"({type(e).__name__}); it is larger than this memory"
        ) from None


def _nested(flat: Mapping[str, Any], paths: Mapping[str, tuple]) -> dict[str, Any]:
    """The flattened names put back where ``paths`` say they came from."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        node: Any = root
        for key, nxt in zip(path, path[1:]):
            node = _child(node, key, [] if isinstance(nxt, int) else {}, fqn)
        _set(node, path[-1], value, fqn)
    return root


def _child(node: Any, key: str | int, empty: Any, fqn: str) -> Any:
    """The container at ``node[key]``, made ``empty`` if there is none yet."""
    if isinstance(node, list) and isinstance(key, int):
        if key >= len(node) or node[key] is None:
            _set(node, key, empty, fqn)
        return node[key]
    if isinstance(node, dict) and isinstance(key, str):
        return node.setdefault(key, empty)
    raise DcpFormatError(f"the saved path of {fqn!r} indexes a {type(node).__name__} with {key!r}")


def _set(node: Any, key: str | int, value: Any, fqn: str) -> None:
    if isinstance(node, list) and isinstance(key, int):
        node.extend([None] * (key + 1 - len(node)))
        node[key] = value
    elif isinstance(node, dict) and isinstance(key, str):
        node[key] = value
    else:
        raise DcpFormatError(f"the saved path of {fqn!r} indexes a {type(node).__name__} with {key!r}")
