"""Turn a training ``state`` into tensors (for DCP) and JSON (for everything else), and back.

``state`` maps names to modules, optimizers, ``Stateful`` objects, tensors or plain
values. Tensors go through torch.distributed.checkpoint; every other leaf must be
JSON-able and is kept in the rank record, so nothing is ever pickled.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptflow.errors import UnsupportedStateError

TENSOR, TUPLE, DICT, BYTES = "__tensor__", "__tuple__", "__dict__", "__bytes__"
_TAGS = {TENSOR, TUPLE, DICT, BYTES}


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
    """Plain nested state dicts for every entry of ``state``."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name or "." in name:
            raise UnsupportedStateError(f"state key {name!r} must be a non-empty string without '.'")
        if isinstance(value, nn.Module):
            out[name] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[name] = get_optimizer_state_dict(_owner(value, modules, name), value)
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach()
        elif _is_stateful(value):
            out[name] = value.state_dict()
        else:
            out[name] = value
    return out


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
        self.names = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer) and not v.state]
        optimizers = [state[k] for k in self.names]
        self._saved = [
            (o, [p.grad for g in o.param_groups for p in g["params"]], vars(o).get("_opt_called", _MISSING))
            for o in optimizers
        ]

    def empty(self, state_dicts: dict[str, Any]) -> None:
        """Save the fresh optimizers as fresh: no per-parameter state."""
        for name in self.names:
            state_dicts[name] = {**state_dicts[name], "state": {}}

    def reset(self) -> None:
        """Put every fresh optimizer back exactly as it was: no state, the same gradients."""
        for optim, grads, called in self._saved:
            optim.state.clear()
            for param, grad in zip((p for g in optim.param_groups for p in g["params"]), grads):
                param.grad = grad
            if called is _MISSING:
                vars(optim).pop("_opt_called", None)
            else:
                optim._opt_called = called


def load_state_dicts(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Apply loaded state dicts to the live objects in ``state`` (in place)."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            set_model_state_dict(value, loaded[name])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(value, modules, name), value, loaded[name])
        elif _is_stateful(value) and not isinstance(value, torch.Tensor):
            value.load_state_dict(loaded[name])
        else:
            state[name] = merge_into(value, loaded[name])


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
    if isinstance(live, MutableMapping) and isinstance(loaded, Mapping):
        for key in [k for k in live if k not in loaded]:
            del live[key]
        for key, value in loaded.items():
            live[key] = merge_into(live.get(key), value)
        return live
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        live[:] = [merge_into(a, b) for a, b in zip(live, loaded)]
        return live
    return loaded


def flatten(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A JSON skeleton of ``tree`` with tensors replaced by references, and those tensors."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            key = ".".join(str(p) for p in path)
            if key in tensors:
                raise UnsupportedStateError(f"two tensors in the state flatten to the same name {key!r}")
            tensors[key] = node
            return {TENSOR: key}
        if isinstance(node, Mapping):
            if all(isinstance(k, str) for k in node) and not _TAGS & set(node):
                return {k: walk(v, path + (k,)) for k, v in node.items()}
            for k in node:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedStateError(
                        f"state at {'.'.join(map(str, path))!r} has key {k!r}; keys must be str or int"
                    )
            return {DICT: [[k, walk(v, path + (k,))] for k, v in node.items()]}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return {TUPLE: [walk(v, path + (i,)) for i, v in enumerate(node)]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, (np.integer, np.floating, np.bool_)):
            return node.item()
        if isinstance(node, (bytes, bytearray)):
            return {BYTES: base64.b64encode(node).decode()}
        raise UnsupportedStateError(
            f"state value at {'.'.join(map(str, path))!r} is a {type(node).__name__}, which ckptflow "
            "cannot store without pickle; convert it to a tensor or JSON-able values "
            "(dict, list, str, int, float, bool, None)"
        )

    return walk(tree, ()), tensors


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            return tensors[skeleton[TENSOR]]
        if TUPLE in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton[TUPLE])
        if DICT in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton[DICT]}
        if BYTES in skeleton:
            return base64.b64decode(skeleton[BYTES])
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def _b64_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


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


def restore_rng(rng: Mapping) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_tensor_b64(rng["torch"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = [_tensor_b64(s) for s in rng["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
