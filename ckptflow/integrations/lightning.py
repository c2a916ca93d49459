"""PyTorch Lightning checkpoints through ckptflow: ``Trainer(plugins=[CkptflowIO(root, run)])``.

Lightning hands its ``CheckpointIO`` the whole checkpoint dict and a file path. The dict
is committed to the store as checkpoint ``global_step`` of ``run`` (tensors as chunks,
everything else as JSON); the path gets a small JSON *pointer* naming that checkpoint,
so ``ModelCheckpoint``'s bookkeeping (top-k files, ``last.ckpt``, ``ckpt_path="last"``)
works unchanged. Loading a pointer returns the dict as it was saved: the ``OrderedDict``
state dict, integer optimizer ids, tuples such as Adam's betas.

What is stored, and what is refused: tensors, and values JSON can say (numbers,
strings, bools, None, lists, tuples, dicts, bytes, numpy scalars). That covers
Lightning's own entries (weights, optimizer and scheduler states, loops, progress,
ModelCheckpoint and EarlyStopping states, precision-plugin state). Whatever else
reaches the dict (a ``save_hyperparameters()`` argument that is a module, a class or an
omegaconf config; a callback state holding a ``Path``) is refused at save, naming its
key, since storing it would need pickle; nothing is written then.

Choices, documented:

- A second save at a step this plugin already saved or loaded (``ModelCheckpoint`` writes
  the top-k file and ``last.ckpt`` at the same step; a monitored one saves again after the
  validation run at a step a step-based one saved) commits nothing new: its pointer names
  the checkpoint of that step and carries the entries this save changed (loops, callbacks'
  state: ``ckptflow.integrations.lightning_overlay``), so loading it gives this save's dict.
  A second save carrying entries the first lacked (a full save after a weights-only one)
  is refused. The newest whole such save also writes its changes, and the score a monitored
  ``ModelCheckpoint`` gave it, into the commit's ``trainer`` record: ``last`` falling back to
  that step resumes with them, and retention's best-K ranks the step by that score.
- A commit's metadata holds the score of each monitored ``ModelCheckpoint`` whose top-k
  holds the path being saved; a save at a step before its validation by one that does not
  monitor (step-based, ``last.ckpt``) carries the previous validation's ``current_score``,
  which is not this step's, so it records none. A monitored step-based one puts that
  earlier value in its top-k itself (Lightning ranks the file by it), so it is recorded
  as Lightning ranks it (docs/integrations.md).
- ``ckpt_path="last"`` (a pointer named ``last*.ckpt``) resumes from the newest checkpoint
  of the run that verifies, falling back past damaged ones as ``Checkpointer.restore``
  does (``CkptflowIO(..., select="validated")``, ``Best(...)`` or ``Alias(...)``: the one
  that selector chooses, ``ckptflow.catalog.selection``); any other pointer loads
  exactly its step, and only the commit it was written for.
- The RNG state saved with the checkpoint (Python, NumPy, torch) is restored on load by
  the process of global rank 0 (the one that saved it), so a resumed run draws the same
  random numbers as an uninterrupted one (``restore_rng=False`` to keep Lightning's
  default of not restoring them).
- ``remove_checkpoint`` deletes the pointer only: the store's retention and GC decide
  when checkpoint data goes.
- Lightning saves from global rank 0 only, so this plugin's ``Checkpointer`` is local
  (no collectives); every rank loads for itself.
- Lightning's own loader (``LightningModule.load_from_checkpoint``, and ``ckpt_path=`` of a
  trainer without this plugin) calls ``torch.load`` on the path and never asks a plugin, so
  on a pointer it fails inside torch. ``load_from_checkpoint(Model, pointer)`` (or the
  ``CkptflowCheckpoints`` mixin, which makes ``Model.load_from_checkpoint(pointer)`` itself
  work) reads the pointer through this plugin, then hands Lightning the dict in memory with
  ``weights_only=True``. A trainer with this plugin loads ``ckpt_path=`` (a pointer,
  ``"last"``, ``"best"``) through it.
- A dict without ``global_step`` is not a training checkpoint (``ddp_spawn`` hands rank
  0's weights back to the main process through the plugin): a plain state dict of
  tensors is written to its path as safetensors, anything else is refused.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import uuid
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from safetensors.torch import load, save

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import selection
from ckptflow.catalog.selection import Selector
from ckptflow.errors import CheckpointExistsError, CkptflowError, UnsupportedStateError
from ckptflow.integrations import lightning_overlay as overlays
from ckptflow.store import Store
from ckptflow.training.checkpointer import Checkpointer, SaveResult
from ckptflow.training.state import capture_rng

try:
    from lightning_fabric.plugins import CheckpointIO
    from lightning_fabric.utilities.cloud_io import get_filesystem
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ckptflow.integrations.lightning needs PyTorch Lightning: pip install 'ckptflow[lightning]'"
    ) from e

log = logging.getLogger("ckptflow")
M = TypeVar("M")

POINTER_KIND = "ckptflow-lightning-pointer"
MAX_POINTER_BYTES = 1 << 20
_LAST = re.compile(r"^last(-v?\d+)?\Z")  # what ModelCheckpoint names its last checkpoint


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CkptflowIO(CheckpointIO):
    """Lightning checkpoints committed to a ckptflow store (``root``) as steps of ``run``."""

    def __init__(
        self,
        root: str | Store,
        run: str,
        *,
        tiers: Sequence[str | Store] = (),
        restore_rng: bool = True,
        chunk_bytes: int = 8 << 20,
        codec: str = "raw",
        select: Selector = "latest",
    ):
        self.root, self.run, self.tiers = root, run, tuple(tiers)
        self.select = selection.check(select)  # what ckpt_path="last" recovers to (ckptflow.catalog.selection)
        self.restore_rng, self.chunk_bytes, self.codec = restore_rng, chunk_bytes, codec
        self._checkpointer: Checkpointer | None = None
        self._steps: dict[int, tuple[frozenset[str], str]] = {}  # saved or loaded here: entries, digest
        # the newest of those steps: its commit's entries, RNG state (None: not known) and the
        # monitored scores its saves reported
        self._encoded: tuple[int, overlays.Fingerprints, dict | None, dict[str, float]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin into each process
        return {**self.__dict__, "_checkpointer": None}

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(
                self.root, self.run, tiers=self.tiers, chunk_bytes=self.chunk_bytes, codec=self.codec, local=True,
                restore_rng=self.restore_rng and _global_rank() == 0,
            )  # fmt: skip
        return self._checkpointer

    # ---- save -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        if "global_step" not in checkpoint:
            _write_weights(checkpoint, path)
            return
        step = int(checkpoint["global_step"])
        entries = frozenset(checkpoint)
        known = self._steps.get(step)
        rng, changes, scores = capture_rng(), {}, overlays.scores(checkpoint, path)
        later = known is not None and self._encoded is not None and self._encoded[0] == step
        if known is None:
            digest = self._commit(step, checkpoint, scores)
            self._steps[step], self._encoded = (entries, digest), (step, overlays.fingerprints(checkpoint), rng, scores)
        elif not entries <= known[0]:
            raise CkptflowError(
                f"step {step} of run {self.run!r} is already saved without {sorted(entries - known[0])}; a checkpoint "
                "per step holds one dict. Use one kind of save per step (e.g. no save_weights_only=True beside "
                "full saves), or a separate CkptflowIO run for weights-only checkpoints"
            )
        else:
            digest = known[1]
            if later and self._encoded is not None:
                changes = overlays.changed(self._encoded[1], checkpoint, self._encoded[2], rng)
                scores = {**self._encoded[3], **scores}
                self._encoded = (*self._encoded[:3], scores)
        ck = self.checkpointer
        pointer = {"kind": POINTER_KIND, "root": ck.store.url, "run": self.run, "step": step, "manifest_digest": digest}
        blob = _pointer_bytes({**pointer, **changes})
        if len(blob) > MAX_POINTER_BYTES:  # a pointer no reader would take: its save's own changes are lost
            log.warning(
                "ckptflow: %s changes %s from the first save at step %d, too large for its pointer (%d bytes); "
                "it names that save's checkpoint as it is", path, overlays.names(changes), step, len(blob),
            )  # fmt: skip
            blob, changes = _pointer_bytes(pointer), {}
        _write_whole(path, blob)  # first: a pointer that failed to be written leaves the record as it was
        if later:
            overlays.record(ck.store, self.run, step, digest, metrics=scores, changes=changes)

    def _commit(self, step: int, checkpoint: dict[str, Any], scores: dict[str, float]) -> str:
        metadata = {"epoch": checkpoint.get("epoch"), "global_step": step, **scores}
        try:
            result = self.checkpointer.save(step, checkpoint, metadata=metadata, kind="full")
        except UnsupportedStateError as e:
            raise UnsupportedStateError(
                f"{e}. In a Lightning checkpoint that is usually a save_hyperparameters() argument (pass JSON values, "
                "or leave it out with save_hyperparameters(ignore=[...])), a callback's state_dict(), or something "
                "added in on_save_checkpoint; ckptflow stores tensors and JSON values only, so nothing was saved"
            ) from None
        except CheckpointExistsError as e:
            raise CheckpointExistsError(
                f"{e}. This run already has a checkpoint at global step {step}: resume it with "
                f"trainer.fit(..., ckpt_path='last'), or train under a new run name"
            ) from None
        assert isinstance(result, SaveResult) and result.info is not None  # blocking and local
        return result.info.digest

    # ---- load -------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """The checkpoint dict a pointer names (``weights_only`` makes no difference:
        nothing is ever unpickled)."""
        pointer = _read_pointer(path)
        if pointer is None:
            return _read_weights(path)
        last = bool(_LAST.match(os.path.splitext(os.path.basename(str(path)))[0]))
        ck = self.checkpointer
        if (pointer["root"], pointer["run"]) != (ck.store.url, self.run):
            ck = Checkpointer(pointer["root"], pointer["run"], local=True,
                              restore_rng=self.restore_rng and _global_rank() == 0)  # fmt: skip
        try:
            if not last:
                digest = catalog.read_manifest(ck.store, ck.run, pointer["step"]).digest
                if digest != pointer["manifest_digest"]:
                    raise CkptflowError(
                        f"{path} names run {ck.run!r} step {pointer['step']} as committed with manifest "
                        f"{pointer['manifest_digest'][:12]}, but that step now holds {digest[:12]} (committed again "
                        "since); load the new one through a pointer written for it"
                    )
            result, checkpoint = ck.load(select=self.select) if last else ck.load(step=pointer["step"])
        finally:
            if ck is not self._checkpointer:
                ck.close()
        for step, why in result.skipped:
            log.warning("ckptflow: skipped step %d of run %s (does not verify): %s", step, ck.run, why)
        if last and result.step != pointer["step"]:
            log.warning("ckptflow: %s names step %d; resuming from step %d", path, pointer["step"], result.step)
        trainer = overlays.recorded(ck.store, ck.run, result.step, result.digest) or {}
        if ck is self._checkpointer:
            scores = {k: v for k, v in result.metadata.items() if isinstance(v, float)}
            self._steps[result.step] = (frozenset(checkpoint), result.digest)
            self._encoded = (
                result.step,
                overlays.fingerprints(checkpoint),
                None,
                {**scores, **trainer.get("metrics", {})},
            )
        if (result.step, result.digest) == (pointer["step"], pointer["manifest_digest"]):
            overlays.apply(pointer, checkpoint, restore=ck.restore_rng, where=str(path))  # what its save changed
        elif isinstance(trainer.get("changes"), dict):  # fell back: the newest save at that step, as recorded
            where = f"the trainer record of run {ck.run!r} step {result.step}"
            remedy = "the record is damaged: delete it (the step then resumes as it was committed)"
            overlays.apply(trainer["changes"], checkpoint, restore=ck.restore_rng, where=where, remedy=remedy)
        return _to_device(checkpoint, map_location) if map_location is not None else checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer; the checkpoint stays in the store until retention and GC remove it."""
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)

    def teardown(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


def load_from_checkpoint(module_class: type[M], path: Any, *, map_location: Any | None = None, **kwargs: Any) -> M:
    """``module_class.load_from_checkpoint(path, ...)`` for a pointer ``CkptflowIO`` wrote.

    Lightning's loader ``torch.load``s the path itself (a JSON pointer, so torch fails with
    "Weights only load failed"); this loads the checkpoint the pointer names from its store
    (verified chunks, exactly its commit), then gives Lightning's own loader that dict in
    memory with ``weights_only=True`` (hyperparameters, ``strict``, ``kwargs`` overrides and
    hooks work as with a file). Anything but a pointer is refused, saying what to do."""
    pointer = _read_pointer(path)
    if pointer is None:
        raise CkptflowError(
            f"{path} holds only weights (safetensors: what ddp_spawn hands back), not a Lightning checkpoint; load "
            "it with safetensors.torch.load_file and model.load_state_dict"
        )
    plugin = CkptflowIO(pointer["root"], pointer["run"], restore_rng=False)
    try:
        checkpoint = plugin.load_checkpoint(path)
    finally:
        plugin.teardown()
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    load = module_class.load_from_checkpoint  # type: ignore[attr-defined]  # a LightningModule class
    return load(buffer, map_location=map_location, weights_only=True, **kwargs)


class CkptflowCheckpoints:
    """Mixin before ``LightningModule`` (``class Model(CkptflowCheckpoints, pl.LightningModule)``):
    ``Model.load_from_checkpoint`` then loads ckptflow pointers too (``load_from_checkpoint``);
    any other path goes to Lightning's loader unchanged."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, os.PathLike)) and is_pointer(checkpoint_path):
            if args:
                raise TypeError("pass map_location, strict and the rest by keyword when loading a ckptflow pointer")
            return load_from_checkpoint(cls, checkpoint_path, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]


def is_pointer(path: Any) -> bool:
    """Whether ``path`` is a small JSON pointer ``CkptflowIO`` wrote (read: at most 1 MiB)."""
    fs = get_filesystem(path)
    if not fs.isfile(path) or fs.size(path) > MAX_POINTER_BYTES:
        return False
    with fs.open(path, "rb") as f:
        blob = f.read(MAX_POINTER_BYTES)
    try:
        pointer = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(pointer, dict) and pointer.get("kind") == POINTER_KIND


def _pointer_bytes(pointer: dict[str, Any]) -> bytes:
    return (json.dumps(pointer, indent=2) + "\n").encode()


def _write_weights(state_dict: dict[str, Any], path: Any) -> None:
    """A dict that is not a training checkpoint: Lightning's ``ddp_spawn`` hands rank 0's
    weights to the main process this way. Written as safetensors (nothing to unpickle)."""
    others = sorted(str(k) for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if others:
        raise CkptflowError(
            "CkptflowIO saves Lightning training checkpoints (with 'global_step') and plain state dicts of "
            f"tensors; {path} would get a dict with the non-tensor entries {others[:8]}"
        )
    _write_whole(
        path, save({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, metadata={"format": "pt"})
    )


def _write_whole(path: Any, blob: bytes) -> None:
    """A file Lightning names, whole or not at all (temporary name, then a rename): a crash
    mid-write must not leave a truncated pointer or weights file where a good one was."""
    fs = get_filesystem(path)
    path = str(path)
    fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(blob)
        fs.mv(tmp, path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def _read_weights(path: Any) -> dict[str, Any]:
    with get_filesystem(path).open(path, "rb") as f:
        return dict(load(f.read()))


def _read_pointer(path: Any) -> dict[str, Any] | None:
    """The pointer at ``path``; None for a safetensors file of weights (``_write_weights``)."""
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise CkptflowError(f"checkpoint {path} does not exist")
    with fs.open(path, "rb") as f:
        blob = f.read(MAX_POINTER_BYTES + 1)
    if _is_safetensors(blob):
        return None
    try:
        pointer = json.loads(blob) if len(blob) <= MAX_POINTER_BYTES else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        pointer = None
    fields = {"root": str, "run": str, "step": int, "manifest_digest": str}
    if not (
        isinstance(pointer, dict)
        and pointer.get("kind") == POINTER_KIND
        and all(isinstance(pointer.get(k), t) for k, t in fields.items())
    ):
        raise CkptflowError(
            f"{path} is not a checkpoint written by CkptflowIO (a JSON pointer into a ckptflow store). A .ckpt "
            "written by Lightning's own TorchCheckpointIO is a pickle, which ckptflow never loads: bring it in "
            "with `ckptflow import ROOT --run R --step N FILE.ckpt` (read with torch.load(weights_only=True)), "
            "or load it without this plugin"
        )
    return pointer


def _is_safetensors(blob: bytes) -> bool:
    """A safetensors file (8 bytes of header length, then its JSON header), not a pointer
    (JSON from the first byte)."""
    return blob[8:9] == b"{" and not blob[:1] == b"{"


def _to_device(tree: Any, device: Any) -> Any:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"CkptflowIO.load_checkpoint: map_location must be a device or its name, got {device!r}")
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree[key] = _to_device(value, device)
        return tree
    if isinstance(tree, list):
        return [_to_device(v, device) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to_device(v, device) for v in tree)
    return tree
