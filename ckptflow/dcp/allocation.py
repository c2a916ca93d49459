"""Tensors allocated from a manifest's declared shapes before any chunk is read.

``load()`` and export allocate each tensor the manifest declares, then fill it through
the verifying reader. A sealed manifest's shapes agree with its chunk lengths
(``dcp_index``), so a damaged size is rare, but a hostile or miswritten manifest can
declare anything: when the allocation fails, the chunks on disk decide whether the
manifest is damaged (they cannot hold that many bytes) or the tensor is simply larger
than this machine's memory.
"""

from __future__ import annotations

import os

import torch

from ckptflow.chunks import codecs
from ckptflow.dcp.metadata import dtype_from_name
from ckptflow.errors import CorruptChunkError, HostMemoryError, ManifestError, ObjectNotFoundError
from ckptflow.format.layout import chunk_key
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import Store


def empty_tensor(store: Store, manifest: Manifest, fqn: str, where: str) -> torch.Tensor:
    """An uninitialised tensor of ``fqn``'s declared shape and dtype. ``ManifestError`` if
    the manifest does not index it or its chunks cannot hold that many bytes (damage);
    ``HostMemoryError`` if they can and this machine cannot allocate it (not the caller's
    state, which ``load`` is not given, and not damage: nothing falls back).

    A tensor larger than this machine's memory is judged before allocating: where the kernel
    overcommits, ``torch.empty`` of terabytes succeeds and the damage would show up later, as
    some other error, or not until the pages are touched."""
    entry = manifest.dcp.tensors.get(fqn)
    if entry is None:
        raise ManifestError(f"{where}: its rank record names tensor {fqn!r}, which its manifest does not index")
    memory = _physical_memory()
    if memory is not None and entry.nbytes > memory:
        failure = f"larger than this machine's {memory} bytes of memory"
    else:
        try:
            return torch.empty(entry.size, dtype=dtype_from_name(entry.dtype))
        except (RuntimeError, MemoryError) as e:
            failure = f"{type(e).__name__}: {e}"
    declared = f"tensor {fqn!r} declares shape {list(entry.size)} ({entry.nbytes} bytes), which cannot be allocated"
    capacity = _capacity(store, manifest, fqn)
    if entry.nbytes > capacity:
        raise ManifestError(
            f"{where}: {declared}, and the chunks on disk that hold it can hold at most {capacity} bytes: "
            "its manifest is damaged"
        )
    raise HostMemoryError(
        f"{where}: {declared} ({failure}); its chunks can hold it: load it on a machine with more memory, or "
        "restore into live objects with restore(), which reads into them in place"
    )


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _capacity(store: Store, manifest: Manifest, fqn: str) -> int:
    """The most raw bytes the stored chunks of ``fqn`` can decode to (``codecs.max_raw_size``)."""
    sizes: dict[str, int] = {}
    total = 0
    for item in manifest.items():
        if item.fqn != fqn:
            continue
        for digest, _ in item.chunks:
            if digest not in sizes:
                try:
                    sizes[digest] = store.stat(chunk_key(digest)).size
                except ObjectNotFoundError:
                    missing = f"chunk {digest[:16]}… of tensor {fqn!r} is missing from {store.url}"
                    raise CorruptChunkError(missing) from None
            total += codecs.max_raw_size(sizes[digest])
    return total
