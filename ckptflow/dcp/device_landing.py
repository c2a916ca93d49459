"""A restore's chunks copied onto a GPU one at a time, through small pinned buffers.

A stored item whose target lives on a device was read into a host staging tensor of the
item's size, then copied over: a 2 GiB embedding held 2 GiB of pinned host memory, and
a shard's items were staged up to the restore's in-flight budget at once. Where the target
is laid out exactly like the stored item (the usual case: the same sharding, dtype and
shape), each verified chunk is instead read into a chunk-sized pinned buffer and copied to
its byte range of the target; at most ``limit`` bytes of such buffers exist at a time, so
host memory no longer grows with the size of a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ckptflow.dcp.memory import tensor_memory


class DeviceLanding:
    """Pinned chunk buffers for copies onto device targets, ``limit`` bytes of them at most
    (a chunk larger than ``limit`` proceeds alone)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._in_use = 0
        self._cond = threading.Condition()

    def land(self, read: Callable[[memoryview], None], target: torch.Tensor, offset: int, size: int) -> None:
        """``read`` fills a pinned buffer of ``size`` bytes, which is then copied into bytes
        ``offset`` to ``offset + size`` of ``target`` (contiguous, on a device). The copy
        blocks this thread, so the buffer is free again when this returns."""
        with self._room(min(size, self.limit)):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            read(tensor_memory(host))
            target.view(-1).view(torch.uint8)[offset : offset + size].copy_(host)

    @contextmanager
    def _room(self, size: int) -> Iterator[None]:
        with self._cond:
            while self._in_use and self._in_use + size > self.limit:
                self._cond.wait()
            self._in_use += size
        try:
            yield
        finally:
            with self._cond:
                self._in_use -= size
                self._cond.notify_all()


def lands_on_device(target: torch.Tensor) -> bool:
    """Whether a restore copies chunks straight onto ``target``: a plain contiguous tensor on
    a CUDA device (the caller checks that it is laid out like the stored item)."""
    return target.device.type == "cuda"
