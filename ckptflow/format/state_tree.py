"""A state tree as a JSON skeleton plus tensors, and back: nothing is ever pickled.

Tensors are replaced by references (their flattened names, the dotted path from the
root) and go through torch.distributed.checkpoint; everything else must be a JSON value
and is stored in the rank record. Values come back as they went in: key order is kept,
an ``OrderedDict`` stays one, a tuple stays a tuple, dict keys that are ints stay ints,
numpy scalars keep their dtype, bytes stay bytes. Tags (``__tensor__`` and friends)
mark what plain JSON cannot say; a user dict that happens to use a tag as a key is
stored in the tagged form, so it cannot be mistaken for one.

``PerRank`` marks a subtree whose tensors each rank keeps its own copy of (their names
get ``@rank<r>``): DCP deduplicates plain tensors with the same name across ranks, which
is right for replicated weights and wrong for, say, per-rank BatchNorm statistics.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptflow.errors import UnsupportedStateError
from ckptflow.format.layout import DTYPE_SIZES

if TYPE_CHECKING:  # torch is imported where tensors are met: parsing a manifest's JSON values needs none
    import torch

TENSOR, TUPLE, DICT, BYTES, ODICT, NUMPY, PER_RANK = (
    "__tensor__", "__tuple__", "__dict__", "__bytes__", "__odict__", "__numpy__", "__per_rank__",
)  # fmt: skip
TAGS = {TENSOR, TUPLE, DICT, BYTES, ODICT, NUMPY, PER_RANK}


class PerRank:
    """``ckptflow.per_rank(value)``: store ``value``'s tensors once per rank, and restore
    each rank's own copy (a restore needs the same world size)."""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"per_rank({self.value!r})"


def per_rank(value: Any) -> PerRank:
    return PerRank(value)


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def unstorable(tensor: torch.Tensor) -> str | None:
    """Why ckptflow cannot store ``tensor`` (as a dense array of a known dtype); None if it can."""
    import torch

    if tensor.is_nested:
        return "is a nested tensor, which ckptflow cannot store: store its components (tensor.unbind()) instead"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}, which ckptflow cannot store: store tensor.to_dense() instead"
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.is_quantized:
        return (
            f"is quantized ({dtype}), which ckptflow cannot store: store tensor.dequantize(), or tensor.int_repr() "
            "with its scale and zero point"
        )
    if dtype not in DTYPE_SIZES:
        return f"has dtype {dtype}, which ckptflow cannot store (it stores {', '.join(sorted(DTYPE_SIZES))})"
    return None


def flatten(tree: Any, rank: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """A JSON skeleton of ``tree`` with tensors replaced by references, and those tensors."""
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple, suffix: str) -> Any:
        if isinstance(node, torch.Tensor):
            name = ".".join(str(p) for p in path) + suffix
            if name in tensors:
                raise UnsupportedStateError(f"two tensors of the state flatten to the name {name!r}; rename one")
            problem = unstorable(node)
            if problem:
                raise UnsupportedStateError(f"tensor at {name!r} {problem}")
            tensor = node.detach()
            if tensor.is_conj():
                tensor = tensor.resolve_conj()
            if tensor.is_neg():
                tensor = tensor.resolve_neg()
            tensors[name] = tensor
            return {TENSOR: name}
        if isinstance(node, PerRank):
            return {PER_RANK: walk(node.value, path, f"@rank{rank}")}
        if isinstance(node, Mapping):
            return _mapping(node, path, lambda v, p: walk(v, p, suffix))
        if isinstance(node, list):
            return [walk(v, path + (i,), suffix) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return {TUPLE: [walk(v, path + (i,), suffix) for i, v in enumerate(node)]}
        if node is None or type(node) in (bool, int, float, str):
            return node
        if isinstance(node, (np.integer, np.floating, np.bool_)):
            return {NUMPY: [node.dtype.str, node.item()]}
        if isinstance(node, (bytes, bytearray)):
            return {BYTES: base64.b64encode(node).decode()}
        raise UnsupportedStateError(
            f"state value at {_path(path)!r} is a {type(node).__module__}.{type(node).__name__}, which ckptflow "
            "cannot store without pickle; convert it to a tensor or to JSON values (dict, list, str, int, "
            "float, bool, None)"
        )

    return walk(tree, (), ""), tensors


def shared_storage(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups of names in ``tensors`` that are one tensor (a tied weight under each of its
    modules' names), in ``tensors``' order: the same storage, offset, shape, strides and
    dtype. Equal values are no proof (every fresh LayerNorm weight is all ones); sharing
    is. Only plain tensors that hold memory are compared (not meta, empty or subclassed
    ones such as DTensor shards)."""
    import torch

    groups: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        if type(t) is not torch.Tensor or t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _mapping(node: Mapping, path: tuple, walk: Any) -> Any:
    for k in node:
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise UnsupportedStateError(f"state at {_path(path)!r} has the key {k!r}; keys must be str or int")
    pairs = [[k, walk(v, path + (k,))] for k, v in node.items()]
    if isinstance(node, OrderedDict):
        return {ODICT: pairs}
    if all(isinstance(k, str) for k in node) and not TAGS & set(node):
        return {k: v for k, v in pairs}
    return {DICT: pairs}


class Unloaded:
    """Stands where a tensor the restore did not load (``strict=False``) would be."""


UNLOADED = Unloaded()


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The tree again; a reference to a tensor not in ``tensors`` becomes ``UNLOADED``."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            return tensors.get(skeleton[TENSOR], UNLOADED)
        if PER_RANK in skeleton:
            return unflatten(skeleton[PER_RANK], tensors)
        if TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
        if ODICT in skeleton:
            return OrderedDict((k, unflatten(v, tensors)) for k, v in skeleton[ODICT])
        if DICT in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton[DICT]}
        if BYTES in skeleton:
            return base64.b64decode(skeleton[BYTES])
        if NUMPY in skeleton:
            dtype, value = skeleton[NUMPY]
            return _numpy_scalar(dtype, value)
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def tensor_refs(skeleton: Any) -> Iterator[str]:
    """Every tensor name a skeleton references (no recursion: skeletons can be deep)."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if TENSOR in node:
                yield node[TENSOR]
            elif DICT in node or ODICT in node:
                stack.extend(v for _, v in node.get(DICT) or node.get(ODICT) or [])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _numpy_scalar(name: Any, value: Any) -> Any:
    """A NumPy scalar of a dtype ``flatten`` writes (bool, int, uint, float). Any other is
    refused: a record names the dtype, and ``np.void(n)`` allocates ``n`` bytes, so 30
    bytes of a hostile record would cost gigabytes."""
    dtype = np.dtype(name)
    if dtype.kind not in "biuf":
        raise ValueError(f"a NumPy value of dtype {str(name)[:40]!r}, which no save writes")
    return dtype.type(value)


def json_value_problem(skeleton: Any, tensors: Collection[str] = ()) -> str | None:
    """Why a stored skeleton cannot be given back as it was saved, or None: a reference to a
    tensor not among ``tensors`` (a manifest's DCP values hold none; a rank record's state
    those its manifest indexes), or a value that does not decode. Checked when a record is
    parsed, so a value is never found bad half-way through a restore, after tensors were
    read into place."""
    try:
        for name in tensor_refs(skeleton):
            if not isinstance(name, str) or name not in tensors:
                return f"refers to tensor {str(name)[:80]!r}, which its manifest does not index"
        unflatten(skeleton, {})
    except (ValueError, TypeError, LookupError, ArithmeticError, RecursionError) as e:
        return f"does not decode ({type(e).__name__}: {e})"
    return None
