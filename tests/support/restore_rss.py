"""A save or a restore in a process of its own, so its peak RSS is its own (VmHWM).

``python restore_rss.py save URL MIB CODEC`` writes a state of MIB MiB (16 tensors,
deterministic) at step 1; with CODEC ``delta`` it writes step 1 with ``codec="auto"`` and an
incremental step 2 in which a few values of every tensor changed, so step 2's chunks are
stored as XOR deltas against step 1's. ``python restore_rss.py restore URL MIB [BUDGET_MIB]``
allocates the same shapes, restores the newest step into them and prints JSON: the RSS before
the restore, the peak during it (MiB), its duration, and whether every tensor came back exactly.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from peak_rss import reset_peak, status_mib  # this directory: run as a script

from ckptflow import Checkpointer

TENSORS = 16


def _shapes(mib: int) -> list[tuple[int, int]]:
    rows = mib * (1 << 20) // 4 // TENSORS // 1024
    return [(rows, 1024)] * TENSORS


def _expected(i: int, shape: tuple[int, int]) -> torch.Tensor:
    """Tensor ``i``'s values: cheap to make again for the check, distinct per tensor."""
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape).mul_(1 / (i + 3))


def _at_step(i: int, shape: tuple[int, int], step: int) -> torch.Tensor:
    """Tensor ``i`` as saved at ``step``: step 2 changes every 1024th value of step 1's."""
    values = _expected(i, shape)
    if step > 1:
        values.view(-1)[::1024] += 1.0
    return values


def main(argv: list[str]) -> None:
    mode, url, mib = argv[0], argv[1], int(argv[2])
    shapes = _shapes(mib)
    if mode == "save":
        codec = argv[3]
        steps = [1, 2] if codec == "delta" else [1]
        with Checkpointer(url, "rss", codec="auto" if codec == "delta" else codec, threads=4) as ck:
            for step in steps:
                state = {f"w{i}": _at_step(i, s, step) for i, s in enumerate(shapes)}
                ck.save(step, state, rng=False, kind="full" if step == 1 else "incremental")
        return
    budget = {"restore_buffer_bytes": int(argv[3]) << 20} if len(argv) > 3 else {}
    state = {f"w{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    with Checkpointer(url, "rss", threads=4, **budget) as ck:
        ck.list()  # imports and clients warmed up before the peak is measured
        before = status_mib("VmRSS")
        reset_peak()
        started = time.perf_counter()
        step = ck.restore(state).step
        seconds = time.perf_counter() - started
        peak = status_mib("VmHWM")
    exact = all(torch.equal(state[f"w{i}"], _at_step(i, s, step)) for i, s in enumerate(shapes))
    print(json.dumps({"before_mib": before, "peak_mib": peak, "seconds": seconds, "exact": exact, "step": step}))


if __name__ == "__main__":
    main(sys.argv[1:])
