"""What an imported state may hold, checked before anything is allocated or written for it
(``check_state``): a save would choke on it or blow it up in memory otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptflow.errors import CkptflowError
from ckptflow.format.state_tree import unstorable
from ckptflow.interop.source_files import check_name_count

MAX_NESTING = 64  # levels of dicts and lists an imported state may nest (a state dict has a handful)
VIEW_BYTES_PER_STORED = 4  # what all views may claim together: this many times the bytes stored ...
VIEW_BYTES_SLACK = 64 << 20  # ... plus this much (a fused weight beside its slices and a transposed view)


def check_state(src: str, state: Any) -> None:
    """Refuse, before anything is allocated or written, what a save would choke on or blow
    up: nesting deeper than ``MAX_NESTING``, tensors without data here (meta, sparse,
    quantized), and views that claim more bytes than the file stores for them: one view
    (a stride-0 ``expand`` of one element is 1.6 KB on disk and gigabytes once made
    contiguous), or all of them together (a thousand overlapping slices of a storage,
    each within it). All views together may claim ``VIEW_BYTES_PER_STORED`` times the
    bytes stored plus ``VIEW_BYTES_SLACK``: a fused weight saved beside its slices and a
    transposed view. Every name counts, tied ones too: the save hashes each name's bytes
    and a restore or export allocates each name its own tensor, so a file naming one
    stored tensor thousands of times (a tied-weights header, shared storages in a
    torch.save file) is that many tensors. A model's tied embeddings are two names of one
    tensor: twice its bytes, well within the bound. And no more than ``MAX_NAMES`` names
    (``check_name_count``): a torch.save file can be counted only once loaded, but before
    the save allocates for each."""
    stack: list[tuple[Any, int, _Where]] = [(state, 0, None)]
    claimed, names = 0, 0  # every name's bytes, as the save and a restore will handle them
    stored: dict[tuple[int, int], int] = {}  # each storage (start, size) -> its bytes
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_NESTING:
            raise CkptflowError(f"{src}: the state nests deeper than {MAX_NESTING} levels (at {_path(where)[:200]!r})")
        if isinstance(node, torch.Tensor):
            check_name_count(names + 1, src)
            _check_tensor(src, where, node)
            storage = node.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())  # an empty storage may start where the next one does
            stored[key] = storage.nbytes()
            claimed += node.numel() * node.element_size()
            names += 1
        elif isinstance(node, Mapping):
            stack.extend((v, depth + 1, (where, k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1, (where, i)) for i, v in enumerate(node))
    held = sum(stored.values())
    if claimed > VIEW_BYTES_PER_STORED * held + VIEW_BYTES_SLACK:
        raise CkptflowError(
            f"{src}: its {names} tensors claim {claimed} bytes together, but the file stores {held} for "
            "them (names that repeat the same bytes: overlapping slices, or one tensor tied to many names); "
            "refused rather than made in memory: save each as its own tensor (t.clone()) if that is meant"
        )


# where a value lies in the state: (where its container lies, its key or index), None for the state itself;
# its dotted path is built only for an error (``_path``): a state of 100,000 names would build them all
_Where = tuple[Any, Any] | None


def _path(where: _Where) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(str(key))
    return ".".join(reversed(keys))


def _what(src: str, where: _Where, tensor: torch.Tensor) -> str:
    return f"{src}: tensor {_path(where)!r} ({list(tensor.shape)}, {tensor.dtype})"


def _check_tensor(src: str, where: _Where, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise CkptflowError(
            f"{_what(src, where, tensor)} is on the {tensor.device.type} device, with no data in the file; "
            "ckptflow imports tensors with their data: save them once they are materialized"
        )
    problem = unstorable(tensor)  # what a save refuses, refused as a save would (ckptflow.format.state_tree)
    if problem:
        raise CkptflowError(f"{_what(src, where, tensor)} {problem}")
    needed, stored = tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes()
    if needed > stored:
        raise CkptflowError(
            f"{_what(src, where, tensor)} needs {needed} bytes, but the file stores {stored} for it (a view that "
            "repeats its elements, like expand()); refused rather than made in memory: save t.contiguous() if it is "
            "meant"
        )
