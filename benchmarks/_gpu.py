"""GPU mode of benchmarks/save_restore.py (``--device cuda --size-gb 10``): saves of a
state living on the GPU, and restores back onto it, against DCP.

  blocked s    how long the training loop is held (async: the copy into pinned host memory)
  total s      until the checkpoint is committed on disk
  GB/s         state bytes / total s (restore: / restore s)
  host MiB     peak resident host memory beyond the process's before the save (with the
               buffers ``prepare`` allocates for ckptflow's async save) or the restore
  next save    blocked s of the following (incremental) async save

ckptflow's async save stages through pinned host buffers allocated by ``prepare()``
and kept for the Checkpointer's life (``ckptflow.dcp.staging``), so it holds the whole
state in host memory, as DCP's does (DCP allocates them at every ``async_save``); its
blocking save copies one chunk at a time through pinned memory, at most
``COPY_AHEAD_BYTES`` ahead of its writes (``ckptflow.dcp.host_copies``). Its restore
verifies every chunk first, then copies each through a chunk-sized pinned buffer onto the
device (``ckptflow.dcp.device_landing``). DCP runs as ``dcp.async_save`` / ``dcp.save`` /
``dcp.load`` with its defaults. Needs a CUDA device: without one it says so and exits 2.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _util import PeakRss, quiet
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ckptflow import Checkpointer

GiB = 1 << 30
TENSOR_BYTES = 256 << 20  # a large transformer's big matrices are of this order


def gpu_state(size_gb: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    count = max(1, int(size_gb * GiB) // TENSOR_BYTES)
    return {f"layer{i}.weight": torch.randn(TENSOR_BYTES // 4, generator=gen, device="cuda") for i in range(count)}


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _dcp(state: dict, work: Path, *, blocking: bool) -> dict[str, float]:
    path = work / "dcp"
    shutil.rmtree(path, ignore_errors=True)
    with quiet():
        with PeakRss() as saving:
            start = _sync()
            if blocking:
                dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
                blocked = total = time.perf_counter() - start
            else:
                future = dcp.async_save(state, storage_writer=FileSystemWriter(path), no_dist=True)
                blocked = time.perf_counter() - start
                future.result()
                total = time.perf_counter() - start
        target = {k: torch.empty_like(v) for k, v in state.items()}
        with PeakRss() as restoring:
            start = _sync()
            dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
            restore = _sync() - start
    _check(state, target, "DCP")
    shutil.rmtree(path, ignore_errors=True)
    return dict(blocked=blocked, total=total, restore=restore, **_peaks(saving, restoring))


def _ckptflow(state: dict, work: Path, *, blocking: bool) -> dict[str, float]:
    root = work / "ckptflow"
    shutil.rmtree(root, ignore_errors=True)
    sample: dict[str, float] = {}
    with Checkpointer(str(root), "gpu") as ck:
        with PeakRss() as saving:  # an async save's host buffers, allocated by ``prepare``, counted
            if not blocking:
                ck.prepare({"model": state})
            start = _sync()
            handle = ck.save(1, {"model": state}, kind="full", blocking=blocking)
            sample["blocked"] = time.perf_counter() - start
            if not blocking:
                handle.wait()
            sample["total"] = time.perf_counter() - start
        if not blocking:
            start = _sync()
            handle = ck.save(2, {"model": state}, kind="incremental", blocking=False)
            sample["warm"] = time.perf_counter() - start
            handle.wait()
        target = {k: torch.empty_like(v) for k, v in state.items()}
        with PeakRss() as restoring:
            start = _sync()
            ck.restore({"model": target}, step=1)
            sample["restore"] = _sync() - start
    _check(state, target, "ckptflow")
    shutil.rmtree(root, ignore_errors=True)
    return {**sample, **_peaks(saving, restoring)}


def _peaks(saving: PeakRss, restoring: PeakRss) -> dict[str, float]:
    return {"save_rss": saving.bytes or 0, "restore_rss": restoring.bytes or 0}


def _check(expected: dict, actual: dict, method: str) -> None:
    for name, tensor in expected.items():
        if not torch.equal(tensor, actual[name]):
            raise AssertionError(f"{method}: {name} restored with different values")


def run(size_gb: float, repeats: int, work: Path) -> int:
    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device here, so the GPU mode has not run (it needs one)")
        return 2
    state = gpu_state(size_gb)
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state: {len(state)} fp32 tensors on {torch.cuda.get_device_name()}, {nbytes / GiB:.1f} GiB")
    work.mkdir(parents=True, exist_ok=True)
    methods = {
        "DCP async_save / dcp.load": lambda: _dcp(state, work, blocking=False),
        "ckptflow async / restore": lambda: _ckptflow(state, work, blocking=False),
        "DCP save (blocking) / dcp.load": lambda: _dcp(state, work, blocking=True),
        "ckptflow blocking / restore": lambda: _ckptflow(state, work, blocking=True),
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    try:
        for _ in range(repeats):
            for name, method in methods.items():
                samples[name].append(method())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "| method | blocked s | total s | save GB/s | save host MiB | restore s | restore GB/s | restore host MiB "
        "| next save blocked s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in samples.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        warm = f"{med['warm']:.3f}" if "warm" in med else "-"
        print(
            f"| {name} | {med['blocked']:.3f} | {med['total']:.3f} | {nbytes / med['total'] / 1e9:.2f} | "
            f"{med['save_rss'] / 2**20:.0f} | {med['restore']:.3f} | {nbytes / med['restore'] / 1e9:.2f} | "
            f"{med['restore_rss'] / 2**20:.0f} | {warm} |"
        )
    return 0
