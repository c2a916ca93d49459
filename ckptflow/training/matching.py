"""Which saved values a restore loads into which live ones: pure, checked before anything
is read or written.

The live state and a checkpoint's rank record are compared entry by entry (the state's
top-level keys). Entries the checkpoint has and the state does not are left unread (a
partial restore: ``{"model": m}`` from a checkpoint that also holds the optimizer).
Within an entry, tensor names must match; with ``strict=False`` the common ones load and
the others are reported, as ``load_state_dict(strict=False)`` does. An optimizer saved
before its first step has no state tensors, and restoring it makes the live one fresh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptflow.errors import StateMismatchError
from ckptflow.format.state_tree import DICT, ODICT, TAGS, tensor_refs

SHOWN = 12  # names listed in an error; the count says how many there are


@dataclass(frozen=True)
class LoadPlan:
    entries: list[str]  # top-level entries restored
    targets: dict[str, torch.Tensor]  # live tensors the checkpoint's values load into
    missing_keys: list[str] = field(default_factory=list)  # live, not in the checkpoint (strict=False)
    unexpected_keys: list[str] = field(default_factory=list)  # in the checkpoint's entries, not live
    # optimizer entry -> parameters it saved no state for (never updated: a BERT pooler), left fresh
    fresh_params: dict[str, list[str]] = field(default_factory=dict)


def entries(skeleton: Any) -> dict[str, Any]:
    """The top-level entries of a state skeleton."""
    if isinstance(skeleton, dict) and (DICT in skeleton or ODICT in skeleton):
        return {str(k): v for k, v in skeleton.get(DICT) or skeleton.get(ODICT) or []}
    if isinstance(skeleton, dict) and not TAGS & set(skeleton):
        return skeleton
    return {}


def plan_load(
    live: Any,
    live_tensors: Mapping[str, torch.Tensor],
    saved: Any,
    optimizers: list[str],
    *,
    strict: bool,
    dropped: Sequence[str] = (),
    saved_shapes: Mapping[str, Sequence[int]] | None = None,
) -> LoadPlan:
    """What to load; ``StateMismatchError`` (strict) naming every difference otherwise.
    ``dropped``: entries the checkpoint left out on purpose (a lossy copy without the
    optimizer), which stay as they are and are no mismatch. ``saved_shapes`` (name ->
    the saved tensor's global shape): a tensor to load whose shape differs is a mismatch
    even with ``strict=False``, as in ``load_state_dict``; found here it stops the restore
    before anything is read, instead of failing inside the read as if the checkpoint were
    damaged (which would fall back to an older one of the old shape)."""
    live_entries, saved_entries = entries(live), entries(saved)
    absent = [name for name in live_entries if name not in saved_entries and name not in dropped]
    missing: set[str] = set()
    unexpected: set[str] = set()
    names: set[str] = set()
    fresh: dict[str, list[str]] = {}
    for name, skeleton in live_entries.items():
        if name not in saved_entries:
            continue
        have, want = set(tensor_refs(saved_entries[name])), set(tensor_refs(skeleton))
        if name in optimizers and not any(n.startswith(f"{name}.state.") for n in have):
            want = {n for n in want if not n.startswith(f"{name}.state.")}  # saved before its first step
        elif name in optimizers:
            unstepped = _unstepped(name, have, want)
            if unstepped:
                fresh[name] = unstepped
                want = {n for n in want if n.rsplit(".", 1)[0] not in {f"{name}.state.{p}" for p in unstepped}}
        missing |= want - have
        unexpected |= have - want
        names |= want & have
    if strict and (absent or missing or unexpected):
        raise StateMismatchError(_describe(absent, missing, unexpected, sorted(saved_entries)))
    _check_shapes({n: live_tensors[n] for n in names}, saved_shapes or {})
    _check_writable({n: live_tensors[n] for n in names})
    return LoadPlan(
        entries=[name for name in live_entries if name in saved_entries],
        targets={n: live_tensors[n] for n in names},
        missing_keys=sorted(missing | {n for name in absent for n in tensor_refs(live_entries[name])} | set(absent)),
        unexpected_keys=sorted(unexpected),
        fresh_params=fresh,
    )


def _check_writable(targets: Mapping[str, torch.Tensor]) -> None:
    """Live tensors a restore cannot read into: on the meta device (deferred init, no
    storage yet) or with elements sharing memory (an ``expand``). Refused here, before
    anything is read, not inside the read as if the checkpoint were damaged."""
    meta = sorted(repr(n) for n, t in targets.items() if t.is_meta)
    overlapping = sorted(
        repr(n)
        for n, t in targets.items()
        if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta and torch._debug_has_internal_overlap(t) == 1
    )
    problems = []
    if meta:
        problems.append(
            f"{len(meta)} tensor(s) of the state are on the meta device ({', '.join(meta[:SHOWN])}): materialize "
            "them first (module.to_empty(device=...)), then restore"
        )
    if overlapping:
        problems.append(
            f"{len(overlapping)} tensor(s) of the state share memory between their elements "
            f"({', '.join(overlapping[:SHOWN])}; an expand()): give them storage of their own (.clone()), then restore"
        )
    if problems:
        raise StateMismatchError("; ".join(problems) + "; nothing was read")


def _check_shapes(targets: Mapping[str, torch.Tensor], saved: Mapping[str, Sequence[int]]) -> None:
    wrong = sorted(
        f"{n!r} (checkpoint {tuple(saved[n])}, state {tuple(t.shape)})"
        for n, t in targets.items()
        if n in saved and tuple(t.shape) != tuple(saved[n])
    )
    if wrong:
        more = f", … ({len(wrong)} in all)" if len(wrong) > SHOWN else ""
        raise StateMismatchError(
            f"tensor shapes differ from the checkpoint's: {', '.join(wrong[:SHOWN])}{more}. Build the state with "
            "the configuration the checkpoint was saved with (a changed model size?), then restore"
        )


def _unstepped(name: str, have: set[str], want: set[str]) -> list[str]:
    """Parameters of optimizer ``name`` the checkpoint holds no state for at all, while it
    holds state for others: the saved optimizer never updated them (no gradient reached
    them), so after the restore they have no state either, which is no mismatch."""
    prefix = f"{name}.state."
    params = lambda keys: {k[len(prefix) :].rsplit(".", 1)[0] for k in keys if k.startswith(prefix)}
    return sorted(params(want) - params(have))


def _describe(absent: list[str], missing: set[str], unexpected: set[str], saved: list[str]) -> str:
    parts = []
    for what, keys in (
        ("entries of the state the checkpoint lacks", absent),
        ("keys missing from the checkpoint", sorted(missing)),
        ("keys in the checkpoint the state lacks", sorted(unexpected)),
    ):
        if keys:
            more = f", … ({len(keys)} in all)" if len(keys) > SHOWN else ""
            parts.append(f"{what}: {', '.join(map(repr, keys[:SHOWN]))}{more}")
    first = (absent or sorted(missing) or sorted(unexpected))[0]
    return (
        f"the state does not match the checkpoint (first mismatched key {first!r}; "
        + "; ".join(parts)
        + f"; the checkpoint holds {saved}). "
        "Restore a subset by passing only the entries it has, or pass strict=False to load what matches"
    )
