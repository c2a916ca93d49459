"""A later save at a step ``CkptflowIO`` already committed: what it changed travels in its pointer.

A checkpoint per step is create-only, yet Lightning saves one step more than once with
different dicts: a step-based ``ModelCheckpoint`` (or a preemption save) at the end of the
batch, then a monitored ``ModelCheckpoint`` after the validation run at that step, its dict
holding ``EarlyStopping``'s and ``ModelCheckpoint``'s updated state and the validation
loop's progress. A pointer naming only the first save's commit resumed with the callbacks as
they were before that validation (early stopping then stopped later than the uninterrupted
run, where a ``torch.save`` resume stops with it). So every save fingerprints its entries
other than the weights and optimizer states (loops, callbacks, schedulers, hyperparameters: a
sha256 of each, nothing kept but the digest, so a callback holding an EMA copy of the weights
costs one hashing pass, not a second copy), and a later save at a committed step writes the
entries whose fingerprint changed into its pointer (``overlay``; a callback's state is
fingerprinted apart, and carried apart in ``callbacks``), and its RNG state (``rng``)
where it differs from the commit's or that is not known (validation between the two saves
drew from it: a shuffled loader); loading that pointer puts them back over the commit's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from ckptflow.errors import CkptflowError
from ckptflow.format.state_tree import flatten, tensor_refs, unflatten
from ckptflow.training.state import restore_rng

# changed by an optimizer step only, never between two saves of one step; also the large entries
FIXED = frozenset({"state_dict", "optimizer_states"})

DAMAGED = "the pointer is damaged: resume from another checkpoint file of the run"
# each callback's state is a part of its own: a monitored ModelCheckpoint's new state does not
# carry an unchanged EMA copy of the weights beside it (that pointer would pass 1 MiB)
CALLBACKS = "callbacks"
Part = tuple[str, ...]  # (entry,) or (CALLBACKS, the callback's state key)
Fingerprints = dict[Part, str]  # part -> the sha256 of its skeleton and its tensors' dtypes, shapes and bytes


def _parts(checkpoint: dict[str, Any]) -> dict[Part, Any]:
    """Each entry of ``checkpoint`` but the ``FIXED`` ones, each callback's state apart."""
    out: dict[Part, Any] = {}
    for key, value in checkpoint.items():
        if key == CALLBACKS and isinstance(value, dict) and all(isinstance(k, str) for k in value):
            out.update(((key, k), v) for k, v in value.items())
        elif key not in FIXED:
            out[(key,)] = value
    return out


def fingerprints(checkpoint: dict[str, Any]) -> Fingerprints:
    """Each part of ``checkpoint`` (``_parts``): equal parts fingerprint equally."""
    return {part: _fingerprint(part[-1], value) for part, value in _parts(checkpoint).items()}


def _fingerprint(key: str, value: Any) -> str:
    skeleton, tensors = flatten({key: value})  # an entry's refusal names its key
    digest = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return digest.hexdigest()


def changed(
    committed: Fingerprints, checkpoint: dict[str, Any], committed_rng: dict | None, rng: dict
) -> dict[str, Any]:
    """The pointer fields of a later save at a committed step: the entries (``overlay``) and
    callbacks' states (``callbacks``), and the RNG state (``rng``, None: the commit's is not
    known) that differ from the commit's."""
    parts = _parts(checkpoint)
    now = {part: _fingerprint(part[-1], value) for part, value in parts.items()}
    fields: dict[str, Any] = {}
    for part in (p for p in now if committed.get(p) != now[p]):
        fields.setdefault("overlay" if len(part) == 1 else CALLBACKS, {})[part[-1]] = _encode(part[-1], parts[part])
    return {**fields, **({"rng": rng} if rng != committed_rng else {})}


def names(changes: dict[str, Any]) -> list[str]:
    """The entries and callbacks' states ``changes`` carries, for a message."""
    return sorted(changes.get("overlay", {})) + [f"{CALLBACKS}[{k!r}]" for k in sorted(changes.get(CALLBACKS, {}))]


def _encode(key: str, value: Any) -> dict[str, str]:
    """One entry as a pointer carries it: its JSON skeleton and its tensors as base64 safetensors."""
    skeleton, tensors = flatten({key: value})
    blob = save({n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()}) if tensors else b""
    return {"skeleton": json.dumps(skeleton), "tensors": base64.b64encode(blob).decode()}


def apply(pointer: dict[str, Any], checkpoint: dict[str, Any], *, restore: bool, where: str) -> None:
    """Put what the save of ``pointer`` changed over the checkpoint of its commit; its RNG state
    is restored if ``restore`` (the ``Checkpointer``'s ``restore_rng``: it restored the commit's)."""
    if "overlay" in pointer:
        checkpoint.update(_decode(pointer["overlay"], where))
    if CALLBACKS in pointer:
        checkpoint.setdefault(CALLBACKS, {}).update(_decode(pointer[CALLBACKS], where))
    if restore and "rng" in pointer:
        try:
            restore_rng(pointer["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CkptflowError(
                f"{where}: its RNG state cannot be restored ({type(e).__name__}: {e}); {DAMAGED}"
            ) from None


def _decode(overlay: Any, where: str) -> dict[str, Any]:
    """The entries an ``overlay`` of a pointer holds; a malformed one is refused, naming ``where``."""
    try:
        out = {}
        for key, entry in overlay.items():
            blob = base64.b64decode(entry["tensors"], validate=True)
            skeleton, tensors = json.loads(entry["skeleton"]), load(blob) if blob else {}
            missing = set(tensor_refs(skeleton)) - set(tensors)
            if missing:
                raise KeyError(f"tensors {sorted(missing)[:4]} of entry {key!r}")
            out[key] = unflatten(skeleton, tensors)[key]
        return out
    except (AttributeError, KeyError, TypeError, ValueError, binascii.Error, SafetensorError) as e:
        raise CkptflowError(
            f"{where}: the entries this pointer's save changed at its step (its 'overlay') cannot be read "
            f"({type(e).__name__}: {e}); {DAMAGED}"
        ) from None
