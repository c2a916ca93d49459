"""Live training objects and their state dicts, both ways; RNG states.

``state`` maps names to modules, optimizers, ``Stateful`` objects, tensors or plain
values (``ckptflow.format.state_tree`` turns the state dicts into tensors and JSON). Restoring writes
into the live objects in place, so whoever holds a reference sees the restored values.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Collection, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptflow.errors import ManifestError, UnsupportedStateError
from ckptflow.format import rng as rng_format
from ckptflow.format.state_tree import UNLOADED, PerRank

log = logging.getLogger("ckptflow")


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _owner(optim: torch.optim.Optimizer, modules: dict[str, nn.Module], name: str) -> nn.Module:
    params = {id(p) for g in optim.param_groups for p in g["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise UnsupportedStateError(
        f"state[{name!r}] is an optimizer whose parameters belong to no single module in the "
        f"state (modules: {sorted(modules)}); add the module it optimizes to the state"
    )


def to_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Plain nested state dicts for every entry of ``state`` (a ``PerRank`` entry stays
    wrapped around its state dict). Keys are any non-empty strings: a model's own
    ``state_dict()`` (``"layer0.weight"`` keys) is a state."""
    for name in state:
        if not isinstance(name, str) or not name:
            raise UnsupportedStateError(f"state key {name!r} must be a non-empty string")
    modules = {k: _unwrapped(v) for k, v in state.items() if isinstance(_unwrapped(v), nn.Module)}
    optimizers = {k: o for k, v in state.items() if isinstance(o := _unwrapped(v), torch.optim.Optimizer)}
    owners = {k: _owner(o, modules, k) for k, o in optimizers.items()}
    together = _with_their_optimizer(modules, owners, state)
    out: dict[str, Any] = {}
    for name, value in state.items():
        inner = _unwrapped(value)
        if name in together:
            sd: Any = together[name]
        elif isinstance(inner, nn.Module):
            sd = get_model_state_dict(inner)
        elif isinstance(inner, torch.optim.Optimizer):
            sd = get_optimizer_state_dict(owners[name], inner)
        elif isinstance(inner, torch.Tensor):
            sd = inner.detach()
        elif _is_stateful(inner):
            sd = inner.state_dict()
        else:
            sd = inner
        out[name] = PerRank(sd) if isinstance(value, PerRank) else sd
    return out


def _with_their_optimizer(
    modules: dict[str, nn.Module], owners: dict[str, nn.Module], state: Mapping[str, Any]
) -> dict[str, Any]:
    """The state dicts of each module that exactly one optimizer of ``state`` optimizes, and
    of that optimizer, from one ``get_state_dict`` call: DCP maps every parameter to its
    name once per call (~60 ms at 1,200 parameters here), not once for each."""
    out: dict[str, Any] = {}
    for module_name, module in modules.items():
        optimizers = [k for k, owner in owners.items() if owner is module]
        if len(optimizers) == 1:
            name = optimizers[0]
            out[module_name], out[name] = get_state_dict(module, _unwrapped(state[name]))
    return out


def _unwrapped(value: Any) -> Any:
    return value.value if isinstance(value, PerRank) else value


_MISSING = object()


class FreshOptimizers:
    """The optimizers in ``state`` that have not stepped yet, and how to put them back.

    DCP's ``get_optimizer_state_dict`` initialises a fresh optimizer with a zero-gradient
    step at learning rate 0, so that it has tensors to save or to load into. That changes
    how training goes on (Adam's step count feeds its bias correction), so a save, and a
    restore that does not succeed, undo it with ``reset``. A fresh optimizer is saved
    with an empty ``state``, so restoring it gives a fresh optimizer again.
    """

    def __init__(self, state: Mapping[str, Any]):
        optimizers = {k: o for k, v in state.items() if isinstance(o := _unwrapped(v), torch.optim.Optimizer)}
        self.names = [k for k, o in optimizers.items() if not o.state]
        self._per_rank = {k for k in self.names if isinstance(state[k], PerRank)}
        self._saved = [
            (o, [p.grad for g in o.param_groups for p in g["params"]], vars(o).get("_opt_called", _MISSING))
            for o in (optimizers[k] for k in self.names)
        ]

    def empty(self, state_dicts: dict[str, Any]) -> None:
        """Save the fresh optimizers as fresh: no per-parameter state."""
        for name in self.names:
            sd = state_dicts[name].value if name in self._per_rank else state_dicts[name]
            state_dicts[name] = {**sd, "state": {}}
            if name in self._per_rank:
                state_dicts[name] = PerRank(state_dicts[name])

    def reset(self, loaded: Collection[str] = ()) -> None:
        """Put every fresh optimizer back exactly as it was: no state, the same gradients;
        all but those named in ``loaded`` (a restore just filled them)."""
        for name, (optim, grads, called) in zip(self.names, self._saved):
            if name in loaded:
                continue
            optim.state.clear()
            for param, grad in zip((p for g in optim.param_groups for p in g["params"]), grads):
                param.grad = grad
            if called is _MISSING:
                vars(optim).pop("_opt_called", None)
            else:
                vars(optim)["_opt_called"] = called


def load_state_dicts(state: MutableMapping[str, Any], loaded: Mapping[str, Any], *, strict: bool = True) -> None:
    """Apply loaded state dicts to the live objects in ``state`` (in place); entries the
    checkpoint does not have (a partial restore) are left alone. With ``strict=False``
    tensors the restore did not load (``UNLOADED``) are left as they are. A parameter an
    optimizer saved no state for (never updated: a BERT pooler) ends with none, as in the
    run that saved it, rather than torch refusing the whole load."""
    modules = {k: _unwrapped(v) for k, v in state.items() if isinstance(_unwrapped(v), nn.Module)}
    for name, value in list(state.items()):
        if name not in loaded:
            continue
        inner, sd = _unwrapped(value), _pruned(loaded[name])
        if isinstance(inner, nn.Module):
            set_model_state_dict(inner, sd, options=StateDictOptions(strict=strict))
        elif isinstance(inner, torch.optim.Optimizer):
            owner = _owner(inner, modules, name)
            unstepped = _unstepped(owner, inner, sd)
            options = StateDictOptions(strict=False) if unstepped else None
            set_optimizer_state_dict(owner, inner, sd, options=options)
            for param in unstepped:
                inner.state.pop(param, None)
        elif _is_stateful(inner) and not isinstance(inner, torch.Tensor):
            inner.load_state_dict(sd)
        elif isinstance(value, PerRank):
            value.value = merge_into(inner, sd)
        else:
            state[name] = merge_into(inner, sd)


def _unstepped(owner: nn.Module, optim: torch.optim.Optimizer, sd: Any) -> list[torch.Tensor]:
    """The optimized parameters an optimizer state dict that has per-parameter state holds
    none for (an empty state is a fresh optimizer, handled by ``FreshOptimizers``)."""
    saved = sd.get("state") if isinstance(sd, Mapping) else None
    if not saved:
        return []
    optimized = {id(p) for g in optim.param_groups for p in g["params"]}
    return [p for n, p in owner.named_parameters() if id(p) in optimized and p.requires_grad and n not in saved]


def _pruned(tree: Any) -> Any:
    """``tree`` without the ``UNLOADED`` leaves (in dicts) a non-strict restore leaves."""
    if isinstance(tree, dict):
        return type(tree)((k, _pruned(v)) for k, v in tree.items() if v is not UNLOADED)
    return tree


def merge_into(live: Any, loaded: Any) -> Any:
    """``loaded``, written into ``live``'s own tensors and containers where shapes allow.

    Whoever holds a reference to a tensor or dict in the state sees the restored values,
    as with ``load_state_dict``; anything that cannot be updated in place is replaced.
    """
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if live.shape == loaded.shape and live.dtype == loaded.dtype:
            if live.data_ptr() != loaded.data_ptr():  # restore usually loads in place already
                with torch.no_grad():
                    live.copy_(loaded)
            return live
        return loaded
    if isinstance(live, MutableMapping) and isinstance(loaded, Mapping) and type(live) is type(loaded):
        for key in [k for k in live if k not in loaded]:
            del live[key]
        for key, value in loaded.items():
            live[key] = merge_into(live.get(key), value)
        return live
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        live[:] = [merge_into(a, b) for a, b in zip(live, loaded)]
        return live
    return loaded


def _b64_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _generator_state(text: str) -> torch.Tensor:
    return torch.frombuffer(rng_format.generator_bytes(text), dtype=torch.uint8)


def capture_rng() -> dict:
    """This process's python, numpy, torch (and CUDA) RNG states as JSON."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)
    rng = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64_tensor(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [_b64_tensor(s) for s in torch.cuda.get_rng_state_all()]
    return rng


def check_rng(rng: Mapping) -> None:
    """``ManifestError`` if torch's CPU generator refuses ``rng``'s state (a rank record's, whose
    other states ``format.rng`` checked when it was parsed): asked of a generator of its own,
    before the restore writes anything, so ``restore_rng`` cannot fail after the tensors."""
    try:
        torch.Generator().set_state(_generator_state(rng["torch"]))
    except (RuntimeError, ValueError) as e:
        raise ManifestError(f"its rng state is not one torch can restore ({e})") from None


def restore_rng(rng: Mapping, where: str) -> list[str]:
    """Give this process's generators the states of ``rng``; the ones it could not (``["cuda"]``
    or none). CUDA states are one per device, so they apply only where this process sees as
    many devices as the saving one did: elsewhere (no CUDA, another count) the GPU's random
    streams do not continue as saved, which a warning naming ``where`` says, not a silence
    that reads as an exact resume."""
    random.setstate(rng_format.python_state(rng))
    np.random.set_state(rng_format.numpy_state(rng))
    torch.set_rng_state(_generator_state(rng["torch"]))
    states = [torch.frombuffer(s, dtype=torch.uint8) for s in rng_format.cuda_states(rng)]
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if states and len(states) == devices:
        torch.cuda.set_rng_state_all(states)
    elif states:
        log.warning(
            "%s: restored the python, numpy and torch RNG states, not CUDA's (%d CUDA devices saved, %d here), "
            "so random numbers drawn on the GPU (dropout) do not continue as saved. Restore on %d CUDA devices "
            "for an exact resume, or reseed deterministically (restore(..., warmup=Warmup(seed=...)))",
            where,
            len(states),
            devices,
            len(states),
        )
        return ["cuda"]
    return []
