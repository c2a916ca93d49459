"""Consolidate a checkpoint's model weights into one plain safetensors file.

Serving and evaluation code wants a single file of full tensors, not a sharded DCP
checkpoint. Full-size tensors are allocated from the manifest's global tensor index
and filled by ``dcp.load`` through our verified reader, so DCP's planner gathers every
shard (several ranks, DTensor shards) into place: no model code and no process group
are needed, and nothing is ever unpickled.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from ckptflow import catalog
from ckptflow import format as fmt
from ckptflow.chunks import ChunkStore
from ckptflow.dcp_io import CheckpointReader
from ckptflow.dcp_meta import dtype_from_name
from ckptflow.errors import CkptflowError, NoValidCheckpointError
from ckptflow.failures import own_errors
from ckptflow.manifest import Manifest
from ckptflow.store import Store, open_store

Progress = Callable[[int], None]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ExportResult:
    run: str
    step: int
    path: str
    tensors: int
    bytes: int  # tensor bytes written, after any dtype conversion
    digest: str  # the source manifest's digest, also recorded in the file's metadata
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer steps that failed to verify


def load_tensors(
    store: Store | str,
    run: str,
    step: int,
    *,
    prefix: str = "model.",
    progress: Progress | None = None,
    threads: int = 8,
) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Full tensors named ``prefix…`` (prefix stripped) and the manifest they came from.

    Every chunk read is verified against its address, so a returned tensor is exactly
    what was saved.
    """
    store = open_store(store)
    manifest = catalog.read_manifest(store, fmt.validate_run(run), fmt.validate_step(step))
    index = manifest.dcp.tensors
    names = sorted(n for n in index if n.startswith(prefix) and len(n) > len(prefix))
    if not names:
        tops = sorted({n.split(".", 1)[0] for n in index})
        raise CkptflowError(
            f"run {run!r} step {step} has no tensors under {prefix!r}; its state holds {tops}: "
            "pass one of those as --key"
        )
    full = {n: torch.empty(index[n].size, dtype=dtype_from_name(index[n].dtype)) for n in names}
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-export") as pool:
        reader = CheckpointReader(ChunkStore(store), manifest, pool, progress)
        try:
            with own_errors():
                dcp.load(full, storage_reader=reader, no_dist=True)
        except CkptflowError as e:
            raise CkptflowError(f"run {run!r} step {step} cannot be exported: {e}") from None
    return {n[len(prefix) :]: t for n, t in full.items()}, manifest


def newest_verified_step(store: Store, run: str, progress: Progress | None = None) -> tuple[int, list[tuple[int, str]]]:
    """The newest committed step that fully verifies, and why each newer one was skipped."""
    skipped: list[tuple[int, str]] = []
    with ThreadPoolExecutor(8, thread_name_prefix="ckptflow-verify") as pool:
        for step in reversed(catalog.committed_steps(store, run)):
            report = catalog.verify_checkpoint(store, run, step, pool, progress)
            if report.ok:
                return step, skipped
            skipped.append((step, "; ".join(report.problems)))
    detail = "; ".join(f"step {s}: {why}" for s, why in skipped) or "it has no committed checkpoints"
    raise NoValidCheckpointError(f"no checkpoint of run {run!r} in {store.url} verifies ({detail})", skipped)


def export_safetensors(
    store: Store | str,
    run: str,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    key: str = "model",
    dtype: str | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write ``key``'s tensors of one checkpoint to ``out`` as a plain safetensors file.

    ``step=None`` picks the newest checkpoint that verifies completely (the whole
    checkpoint, not only the exported tensors: a partly corrupt checkpoint is suspect).
    ``dtype`` ("bf16", "fp16", "fp32") converts floating-point tensors only; integer
    buffers keep their dtype. The file is written under a temporary name and renamed,
    so ``out`` is never left half-written.
    """
    store = open_store(store)
    fmt.validate_run(run)
    if dtype is not None and dtype not in DTYPES:
        raise CkptflowError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    out = os.path.abspath(os.fspath(out))
    if not os.path.isdir(os.path.dirname(out)):
        raise CkptflowError(f"output directory {os.path.dirname(out)} does not exist; create it first")
    skipped: list[tuple[int, str]] = []
    if step is None:
        step, skipped = newest_verified_step(store, run, progress)
    tensors, manifest = load_tensors(store, run, step, prefix=key.rstrip(".") + ".", progress=progress)
    if dtype is not None:
        target = DTYPES[dtype]
        tensors = {n: t.to(target) if t.is_floating_point() else t for n, t in tensors.items()}
    nbytes = write_safetensors(tensors, out, lineage_metadata(run, step, manifest.digest, key))
    return ExportResult(run, step, out, len(tensors), nbytes, manifest.digest, skipped)


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


def write_safetensors(tensors: dict[str, torch.Tensor], out: str | os.PathLike, metadata: dict[str, str]) -> int:
    """Write atomically (temp file, then rename): a reader never sees half a file. Returns bytes."""
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sum(t.numel() * t.element_size() for t in tensors.values())
