"""GPU mode of benchmarks/save_restore.py (``--device cuda --size-gb 10``): async save of
a state living on the GPU, and restore back onto it, against DCP.

  blocked s   how long the training loop is held (device-to-host copy into pinned memory)
  total s     until the checkpoint is committed on disk
  GB/s        state bytes / total s (restore: / restore s)

ckptflow's async save stages through pinned host buffers allocated by ``prepare()``
with non-blocking copies (DCP's ``DefaultStager``); its restore reads each item into a
pinned buffer, verifies it, and copies it to the device without blocking. DCP runs as
``dcp.async_save`` / ``dcp.load`` with its defaults. Needs a CUDA device; without one it
says so and exits 2.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _util import quiet
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


def _dcp(state: dict, work: Path) -> dict[str, float]:
    path = work / "dcp"
    shutil.rmtree(path, ignore_errors=True)
    with quiet():
        start = _sync()
        future = dcp.async_save(state, storage_writer=FileSystemWriter(path), no_dist=True)
        blocked = time.perf_counter() - start
        future.result()
        total = time.perf_counter() - start
        target = {k: torch.empty_like(v) for k, v in state.items()}
        start = _sync()
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
        restore = _sync() - start
    _check(state, target, "DCP")
    shutil.rmtree(path, ignore_errors=True)
    return dict(blocked=blocked, total=total, restore=restore)


def _ckptflow(state: dict, work: Path) -> dict[str, float]:
    root = work / "ckptflow"
    shutil.rmtree(root, ignore_errors=True)
    with Checkpointer(str(root), "gpu") as ck:
        ck.prepare({"model": state})
        start = _sync()
        handle = ck.save(1, {"model": state}, kind="full", blocking=False)
        blocked = time.perf_counter() - start
        handle.wait()
        total = time.perf_counter() - start
        start = _sync()
        handle = ck.save(2, {"model": state}, kind="incremental", blocking=False)
        warm = time.perf_counter() - start
        handle.wait()
        target = {k: torch.empty_like(v) for k, v in state.items()}
        start = _sync()
        ck.restore({"model": target}, step=1)
        restore = _sync() - start
    _check(state, target, "ckptflow")
    shutil.rmtree(root, ignore_errors=True)
    return dict(blocked=blocked, total=total, restore=restore, warm=warm)


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
    samples: dict[str, list[dict[str, float]]] = {"DCP async_save / dcp.load": [], "ckptflow async / restore": []}
    try:
        for _ in range(repeats):
            samples["DCP async_save / dcp.load"].append(_dcp(state, work))
            samples["ckptflow async / restore"].append(_ckptflow(state, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| method | blocked s | total s | save GB/s | restore s | restore GB/s | next save blocked s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in samples.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        warm = f"{med['warm']:.3f}" if "warm" in med else "-"
        print(
            f"| {name} | {med['blocked']:.3f} | {med['total']:.3f} | {nbytes / med['total'] / 1e9:.2f} | "
            f"{med['restore']:.3f} | {nbytes / med['restore'] / 1e9:.2f} | {warm} |"
        )
    return 0
