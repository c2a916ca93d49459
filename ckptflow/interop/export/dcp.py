"""Export a checkpoint as a plain torch.distributed.checkpoint directory: no lock-in.

``export_dcp(store, run, out)`` writes what ``dcp.save(state,
storage_writer=FileSystemWriter(out))`` would have written for the checkpoint's state,
so ``dcp.load(state, storage_reader=FileSystemReader(out))`` reads it without ckptflow.
Tensors are full (shards gathered); the JSON values go in as DCP stores non-tensors
(pickled BYTE_IO items: writing them is safe, DCP's reader unpickles them); the state
is rank 0's view (``per_rank`` entries: rank 0's copy, since DCP would merge per-rank
tensors of one name). ``ckptflow.json`` beside the DCP files names the source
checkpoint and carries its metadata, so ``ckptflow import`` of the directory keeps it;
for a lossy archive copy (exported only with ``allow_lossy``) also its ``lossy`` record,
which the import commits again, so the new checkpoint restores only with ``allow_lossy``.
Every file is fsynced (DCP's writer syncs its own, ``sync_files``), then the directory,
before it is renamed into place, and its parent after: once ``export_dcp`` returns, a
crash cannot leave the directory without a file or a file empty.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ckptflow.catalog import checkpoints as catalog
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.format.state_tree import tensor_refs, unflatten
from ckptflow.interop.export.files import DISK, write_text
from ckptflow.interop.export.model import ExportResult, _check_out
from ckptflow.interop.export.tensors import Admitted, Progress, admit, load_tensors, newest_verified_step
from ckptflow.store import Store, open_store

SIDECAR = "ckptflow.json"  # beside the DCP files: the source checkpoint and its metadata


def load_state(
    store: Store, admitted: Admitted, progress: Progress | None = None
) -> tuple[dict[str, Any], Manifest, dict[str, torch.Tensor]]:
    """The admitted checkpoint's state as rank 0 saved it (every chunk verified), its
    manifest, and its tensors by flattened name."""
    manifest, run, step = admitted.manifest, admitted.manifest.run, admitted.manifest.step
    record = catalog.read_rank_record(store, manifest, 0)
    needed = set(tensor_refs(record.state))
    tensors: dict[str, torch.Tensor] = {}
    if needed:
        tensors, read = load_tensors(store, run, step, prefix="", progress=progress)
        admitted.check_same(read)
    state = unflatten(record.state, tensors)
    assert isinstance(state, dict)  # a saved state is a mapping of entries
    return state, manifest, {n: tensors[n] for n in needed}


def export_dcp(
    store: Store | str,
    run: str,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    progress: Progress | None = None,
    allow_lossy: bool = False,
    allow_failed: bool = False,
) -> ExportResult:
    """Write one checkpoint (default: the newest that fully verifies, past damaged ones
    only: ``newest_verified_step``) to the new directory ``out`` as a plain DCP
    checkpoint; the directory appears whole or not at all. A lossy archive copy needs
    ``allow_lossy``, a commit whose validation failed ``allow_failed`` (``admit``).
    ``progress`` is called with the bytes of the tensors read for it, not those the
    verification of ``step=None`` reads."""
    store = open_store(store)
    fmt.validate_run(run)
    out = os.path.abspath(os.fspath(out))
    _check_out(out, as_dir=True)
    skipped: list[tuple[int, str]] = []
    if step is None:
        step, skipped = newest_verified_step(store, run)
    admitted = admit(store, run, step, allow_lossy=allow_lossy, allow_failed=allow_failed)
    state, manifest, tensors = load_state(store, admitted, progress)
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
        sidecar = {"run": run, "step": step, "manifest_digest": manifest.digest, "metadata": manifest.metadata}
        if admitted.lossy is not None:
            sidecar["lossy"] = admitted.lossy
        if admitted.failed_validation is not None:
            sidecar["failed_validation"] = admitted.failed_validation
        write_text(os.path.join(tmp, SIDECAR), json.dumps(sidecar, indent=2) + "\n")  # fsynced
        DISK.fsync_dir(tmp)  # every name in it, .metadata's rename from its temporary name included
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked before): the rename replaces it
        os.rename(tmp, out)
        DISK.fsync_dir(os.path.dirname(out))  # the directory's own name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportResult(
        run=run,
        step=step,
        path=out,
        tensors=len(tensors),
        bytes=nbytes,
        digest=manifest.digest,
        files=tuple(sorted(os.listdir(out))),
        skipped=skipped,
        lossy=admitted.lossy,
        failed_validation=admitted.failed_validation,
    )
