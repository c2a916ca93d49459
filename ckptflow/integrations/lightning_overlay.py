"""A later save at a step ``CkptflowIO`` already committed: what it changed travels in its pointer.

A checkpoint per step is create-only, yet Lightning saves one step more than once with
different dicts: a step-based ``ModelCheckpoint`` (or a preemption save) at the end of the
batch, then a monitored ``ModelCheckpoint`` after the validation run at that step, its dict
holding ``EarlyStopping``'s and ``ModelCheckpoint``'s updated state and the validation
loop's progress. A pointer naming only the first save's commit resumed with the callbacks as
they were before that validation (early stopping then stopped later than the uninterrupted
run, where a ``torch.save`` resume stops with it). So every save encodes its entries other
than the weights and optimizer states (loops, callbacks, schedulers, hyperparameters: small),
and a later save at a committed step writes the entries it changed into its pointer
(``overlay``), and its RNG state (``rng``) where it differs from the commit's or that is not
known (validation between the two saves drew from it: a shuffled loader); loading that pointer
puts them back over the commit's.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load, save

from ckptflow.errors import CkptflowError
from ckptflow.format.state_tree import flatten, tensor_refs, unflatten
from ckptflow.training.state import restore_rng

# changed by an optimizer step only, never between two saves of one step; also the large entries
FIXED = frozenset({"state_dict", "optimizer_states"})

DAMAGED = "the pointer is damaged: resume from another checkpoint file of the run"
Encoded = dict[str, dict[str, str]]  # entry -> {"skeleton": its JSON skeleton, "tensors": base64 safetensors}


def encode(checkpoint: dict[str, Any]) -> Encoded:
    """Each entry of ``checkpoint`` but the ``FIXED`` ones, as JSON: equal entries encode equally."""
    out: Encoded = {}
    for key, value in checkpoint.items():
        if key in FIXED:
            continue
        skeleton, tensors = flatten({key: value})  # an entry's refusal names its key
        blob = save({n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()}) if tensors else b""
        out[key] = {"skeleton": json.dumps(skeleton), "tensors": base64.b64encode(blob).decode()}
    return out


def changed(committed: Encoded, later: Encoded, committed_rng: dict | None, rng: dict) -> dict[str, Any]:
    """The pointer fields of a later save at a committed step: the entries (``overlay``) and
    the RNG state (``rng``, None: the commit's is not known) that differ from the commit's."""
    overlay = {k: v for k, v in later.items() if committed.get(k) != v}
    return {**({"overlay": overlay} if overlay else {}), **({"rng": rng} if rng != committed_rng else {})}


def apply(pointer: dict[str, Any], checkpoint: dict[str, Any], *, restore: bool, where: str) -> None:
    """Put what the save of ``pointer`` changed over the checkpoint of its commit; its RNG state
    is restored if ``restore`` (the ``Checkpointer``'s ``restore_rng``: it restored the commit's)."""
    if "overlay" in pointer:
        checkpoint.update(_decode(pointer["overlay"], where))
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
