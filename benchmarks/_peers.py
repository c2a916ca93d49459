"""The peers' methods of the save/restore benchmark (``save_restore.py``): torch.save,
safetensors, a dd-style write, DCP sync and async, a plain host copy; and the cold
restore every row that restores also measures. ``Bench`` adds ckptflow's methods."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _report import Sample
from _states import MiB, StateDict
from _util import Clock, check_equal, clear, copy_into, disk_usage, drop_page_cache, fresh, fsync_file, quiet
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


class PeerMethods:
    """One round of each peer; the state, the live target and the scratch directory are
    ``Bench``'s fields."""

    state: StateDict
    target: StateDict  # same shapes; restores write into it
    work: Path
    baseline_fsync: bool

    def torch_save(self, _round: int) -> Sample:
        path = fresh(self.work / "torch") / "model.pt"
        clock = Clock().start()
        torch.save(self.state, path)
        if self.baseline_fsync:
            fsync_file(path)
        save, cpu = clock.lap(), clock.cpu_used()
        clear(self.target)
        clock.start()
        copy_into(self.target, torch.load(path, weights_only=True))
        restore, restore_cpu = clock.lap(), clock.cpu_used()
        check_equal(self.state, self.target, "torch.save")
        cold = self._cold(path, lambda: copy_into(self.target, torch.load(path, weights_only=True)), "torch.load")
        return dict(
            blocked=save, total=save, cpu=cpu, bytes=disk_usage(path), restore=restore, restore_cpu=restore_cpu, **cold
        )

    def safetensors(self, _round: int) -> Sample:
        path = fresh(self.work / "safetensors") / "model.safetensors"
        clock = Clock().start()
        save_file(self.state, str(path))
        if self.baseline_fsync:
            fsync_file(path)
        save, cpu = clock.lap(), clock.cpu_used()
        clear(self.target)
        clock.start()
        copy_into(self.target, load_file(str(path)))
        restore, restore_cpu = clock.lap(), clock.cpu_used()
        check_equal(self.state, self.target, "safetensors")
        cold = self._cold(path, lambda: copy_into(self.target, load_file(str(path))), "safetensors")
        return dict(
            blocked=save, total=save, cpu=cpu, bytes=disk_usage(path), restore=restore, restore_cpu=restore_cpu, **cold
        )

    def dd_write(self, _round: int) -> Sample:
        """The disk's own rate: the state's bytes written to one file with plain ``os.write``
        calls and one fsync (of the file and its directory), as ``dd ... conv=fsync`` does."""
        path = fresh(self.work / "dd") / "state.bin"
        clock = Clock().start()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for tensor in self.state.values():
                view = memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()).cast("B")
                while len(view):
                    view = view[os.write(fd, view[: 64 * MiB]) :]
        finally:
            os.close(fd)
        fsync_file(path)
        save, cpu = clock.lap(), clock.cpu_used()
        return dict(blocked=save, total=save, cpu=cpu, bytes=disk_usage(path))

    def dcp_sync(self, _round: int) -> Sample:
        path = fresh(self.work / "dcp")
        with quiet():
            clock = Clock().start()
            dcp.save(self.state, storage_writer=FileSystemWriter(path), no_dist=True)
            save, cpu = clock.lap(), clock.cpu_used()
            clear(self.target)
            clock.start()
            dcp.load(self.target, storage_reader=FileSystemReader(path), no_dist=True)
            restore, restore_cpu = clock.lap(), clock.cpu_used()
            check_equal(self.state, self.target, "DCP")
            cold = self._cold(path, lambda: dcp.load(self.target, storage_reader=FileSystemReader(path), no_dist=True))
        return dict(
            blocked=save, total=save, cpu=cpu, bytes=disk_usage(path), restore=restore, restore_cpu=restore_cpu, **cold
        )

    def dcp_async(self, _round: int) -> Sample:
        path = fresh(self.work / "dcp_async")
        with quiet():
            clock = Clock().start()
            future = dcp.async_save(self.state, storage_writer=FileSystemWriter(path), no_dist=True)
            blocked = clock.lap()
            future.result()
            total, cpu = clock.lap(), clock.cpu_used()
        return dict(blocked=blocked, total=total, cpu=cpu, bytes=disk_usage(path))

    def clone(self, _round: int) -> Sample:
        """The floor an async save's blocked time is measured against: a plain host copy."""
        clock = Clock().start()
        copy = {name: tensor.clone() for name, tensor in self.state.items()}
        blocked, cpu = clock.lap(), clock.cpu_used()
        del copy
        return dict(blocked=blocked, total=blocked, cpu=cpu)

    def _cold(self, path: Path, restore: Callable[[], object], method: str = "DCP") -> Sample:
        """``restore`` again with the files under ``path`` evicted from the page cache."""
        drop_page_cache(path)
        clear(self.target)
        clock = Clock().start()
        restore()
        cold = clock.lap()
        check_equal(self.state, self.target, f"{method} (cold)")
        return dict(cold_restore=cold)
