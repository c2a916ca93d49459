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
Entries and callbacks' states the later save lacks (a weights-only save after a full one) are
named in ``dropped`` and taken out at load, so its pointer gives Lightning the dict it saved.

The newest later save at a step also writes those changes, and the monitored metrics it
scored, into the commit's ``trainer`` lifecycle record (``record``): a resume from
``last.ckpt`` that falls back past a damaged step to this one finds them without its pointer,
and retention's best-K ranks the step by the score its validation gave it, not by nothing.
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

from ckptflow.catalog.verdicts import Subject, read_record, write_record
from ckptflow.errors import CkptflowError
from ckptflow.format.state_tree import flatten, tensor_refs, unflatten
from ckptflow.store.base import Store
from ckptflow.training.state import restore_rng

# changed by an optimizer step only, never between two saves of one step; also the large entries
FIXED = frozenset({"state_dict", "optimizer_states"})

DAMAGED = "the pointer is damaged: resume from another checkpoint file of the run"
# each callback's state is a part of its own: a monitored ModelCheckpoint's new state does not
# carry an unchanged EMA copy of the weights beside it (that pointer would pass 1 MiB)
CALLBACKS = "callbacks"
Part = tuple[str, ...]  # (entry,) or (CALLBACKS, the callback's state key)
Fingerprints = dict[Part, str]  # part -> the sha256 of its skeleton and its tensors' dtypes, shapes and bytes
_HOLDER = object()  # the value of the part that stands for the ``callbacks`` entry beside its callbacks' states
TRAINER = "trainer"  # the lifecycle record of what later saves at a committed step changed (``record``)


def _parts(checkpoint: dict[str, Any]) -> dict[Part, Any]:
    """Each entry of ``checkpoint``, each callback's state apart (the ``callbacks`` entry itself
    then a part of no value, so a save without it is told from one without callbacks)."""
    out: dict[Part, Any] = {}
    for key, value in checkpoint.items():
        if key == CALLBACKS and isinstance(value, dict) and all(isinstance(k, str) for k in value):
            out[(key,)] = _HOLDER
            out.update(((key, k), v) for k, v in value.items())
        else:
            out[(key,)] = value
    return out


def fingerprints(checkpoint: dict[str, Any]) -> Fingerprints:
    """Each part of ``checkpoint`` (``_parts``): equal parts fingerprint equally; a ``FIXED``
    entry and the ``callbacks`` holder are not hashed (their fingerprint is "": only whether a
    save holds them counts)."""
    return {part: _fingerprint(part, value) for part, value in _parts(checkpoint).items()}


def _fingerprint(part: Part, value: Any) -> str:
    if part[0] in FIXED or value is _HOLDER:
        return ""
    skeleton, tensors = flatten({part[-1]: value})  # an entry's refusal names its key
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
    known) that differ from the commit's, and the parts the commit has that this save lacks
    (``dropped``). A part not hashed is never carried (``save_checkpoint`` refuses a later
    save holding an entry its commit lacks)."""
    parts = _parts(checkpoint)
    now = {part: _fingerprint(part, value) for part, value in parts.items()}
    fields: dict[str, Any] = {}
    for part in (p for p in now if committed.get(p) != now[p] and now[p]):
        fields.setdefault("overlay" if len(part) == 1 else CALLBACKS, {})[part[-1]] = _encode(part[-1], parts[part])
    dropped = sorted(list(p) for p in committed if p not in now)
    return {**fields, **({"dropped": dropped} if dropped else {}), **({"rng": rng} if rng != committed_rng else {})}


def names(changes: dict[str, Any]) -> list[str]:
    """The entries and callbacks' states ``changes`` carries, for a message."""
    return sorted(changes.get("overlay", {})) + [f"{CALLBACKS}[{k!r}]" for k in sorted(changes.get(CALLBACKS, {}))]


def scores(checkpoint: dict[str, Any], path: Any) -> dict[str, float]:
    """The score each monitored ModelCheckpoint gave the save to ``path`` (what retention's
    best-K and the lifecycle read): its top-k entry for that path, set just before it saves.
    Another save at the step (step-based, ``last.ckpt``) holds no entry: the callback's
    ``current_score`` there is an earlier validation's."""
    out: dict[str, float] = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        if (
            isinstance(state, dict)
            and isinstance(state.get("monitor"), str)
            and isinstance(state.get("best_k_models"), dict)
        ):
            score = state["best_k_models"].get(str(path))
            if isinstance(score, torch.Tensor) and score.numel() == 1 and torch.isfinite(score):
                out[state["monitor"]] = float(score)
    return out


def record(store: Store, run: str, step: int, digest: str, *, metrics: dict[str, float], changes: dict) -> None:
    """The ``trainer`` record of commit ``digest``: the newest later save's ``changes`` (those
    ``changed`` returns; {} when they were too large for a pointer) and every monitored
    metric a save at the step scored. Replaced by each later save, except that a
    weights-only save after full ones (its ``dropped`` names the optimizer states or the
    callbacks entry) is no point to resume training from: the record keeps the newest
    whole save's changes (a fallback applying its ``dropped`` would resume with no
    optimizer state). A whole save that drops only a callback's state (Lightning leaves
    out a callback whose state is empty) replaces it as any other does."""
    if not _whole(changes):
        kept = recorded(store, run, step, digest) or {}
        changes = kept["changes"] if isinstance(kept.get("changes"), dict) else {}
    write_record(store, Subject(run, step, digest), TRAINER, {"metrics": metrics, "changes": changes})


def _whole(changes: dict[str, Any]) -> bool:
    """Whether the save of ``changes`` holds what resuming training needs: a weights-only
    save drops the optimizer states and the ``callbacks`` entry, a whole one at most some
    callbacks' states."""
    dropped = changes.get("dropped") or []
    return not any(isinstance(p, list) and len(p) == 1 and p[0] in (*FIXED, CALLBACKS) for p in dropped)


def recorded(store: Store, run: str, step: int, digest: str) -> dict[str, Any] | None:
    """The ``trainer`` record of commit ``digest``; None when there is none or it is damaged
    (said in the log): the commit then loads as it was committed."""
    return read_record(store, Subject(run, step, digest), TRAINER)


def _encode(key: str, value: Any) -> dict[str, str]:
    """One entry as a pointer carries it: its JSON skeleton and its tensors as base64 safetensors."""
    skeleton, tensors = flatten({key: value})
    blob = save({n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()}) if tensors else b""
    return {"skeleton": json.dumps(skeleton), "tensors": base64.b64encode(blob).decode()}


def apply(
    pointer: dict[str, Any], checkpoint: dict[str, Any], *, restore: bool, where: str, remedy: str = DAMAGED
) -> None:
    """Put what the save of ``pointer`` changed over the checkpoint of its commit; its RNG state
    is restored if ``restore`` (the ``Checkpointer``'s ``restore_rng``: it restored the commit's)."""
    if "overlay" in pointer:
        checkpoint.update(_decode(pointer["overlay"], where, remedy))
    if CALLBACKS in pointer:
        checkpoint.setdefault(CALLBACKS, {}).update(_decode(pointer[CALLBACKS], where, remedy))
    for part in _dropped(pointer.get("dropped", []), where, remedy):
        holder = checkpoint.get(CALLBACKS) if len(part) == 2 else checkpoint
        if isinstance(holder, dict):
            holder.pop(part[-1], None)
    if restore and "rng" in pointer:
        try:
            restore_rng(pointer["rng"], where)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CkptflowError(
                f"{where}: its RNG state cannot be restored ({type(e).__name__}: {e}); {remedy}"
            ) from None


def _dropped(dropped: Any, where: str, remedy: str) -> list[Part]:
    """The parts a pointer's ``dropped`` names; a malformed one is refused, naming ``where``."""
    parts = (
        [tuple(p) for p in dropped] if isinstance(dropped, list) and all(isinstance(p, list) for p in dropped) else None
    )
    if parts is None or not all(
        all(isinstance(k, str) for k in p) and (len(p) == 1 or (len(p) == 2 and p[0] == CALLBACKS)) for p in parts
    ):
        raise CkptflowError(
            f"{where}: the entries its save left out ('dropped': {dropped!r:.200}) cannot be read; {remedy}"
        )
    return parts


def _decode(overlay: Any, where: str, remedy: str) -> dict[str, Any]:
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
            f"({type(e).__name__}: {e}); {remedy}"
        ) from None
