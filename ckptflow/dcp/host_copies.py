"""Host copies of the tensors a blocking save cannot read in place (on a GPU), made one
chunk at a time, with a bounded number of bytes waiting for their writes.

Copying such a tensor whole before writing it (what ``bytes_view`` does) holds the whole
shard in host memory by the end of a save: at 10-80 GB per rank on GPUs that is the limit
of the machine. Here each chunk-sized slice is copied when its write is queued, and a new
copy waits for the oldest writes once ``limit`` bytes of copies are in flight, so a save's
host memory stays about ``limit`` whatever the state's size (DCP bounds its copy-ahead
the same way). A small tensor a pack holds (``packs``) is copied whole, once there is
room, and counted with its pack once that is handed to its write: a state of many small
tensors would otherwise be copied entirely while the writes lag. Chunks are copied through
pinned memory where the tensor is on a CUDA device: a pageable copy is staged by the driver
through its own pinned buffer anyway, at half the rate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from ckptflow.dcp.memory import bytes_view, tensor_memory
from ckptflow.dcp.packs import Pack
from ckptflow.dcp.put_batches import PutBatches, Slot

COPY_AHEAD_BYTES = 256 << 20


def copied_in_chunks(tensor: torch.Tensor) -> bool:
    """Whether a save copies ``tensor`` chunk by chunk: it lives on a device, not in host memory."""
    return tensor.device.type not in ("cpu", "meta")


class HostCopies:
    """Chunk-sized host copies of device tensors for one save, at most ``limit`` bytes of
    them queued or being written (one chunk more while the next is made)."""

    def __init__(self, batches: PutBatches, *, limit: int = COPY_AHEAD_BYTES):
        self.batches, self.limit = batches, limit
        self._waiting: deque[tuple[int, Slot]] = deque()
        self._bytes = 0
        self._in_packs: dict[int, int] = {}  # per pack not yet written (by id): bytes of copies in it

    def pieces(self, tensor: torch.Tensor, step: int) -> Iterator[memoryview]:
        """``tensor``'s bytes in slices of ``step``, each a host copy made as it is asked for.
        The caller hands each slice's write slot to ``queued`` before asking for the next."""
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)  # a copy on the device, if any
        pinned = data.device.type == "cuda"
        for offset in range(0, data.numel(), step):
            part = data[offset : offset + step]
            self._make_room(part.numel())
            host = torch.empty(part.numel(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(part)  # blocking: the slice is in host memory when it is handed over
            yield tensor_memory(host)

    def whole(self, tensor: torch.Tensor) -> memoryview:
        """A host copy of a small tensor a pack will hold, made once there is room for it."""
        self._make_room(tensor.numel() * tensor.element_size())
        return bytes_view(tensor)

    def packed(self, pack: Pack, nbytes: int) -> None:
        """``pack`` holds a copy of ``nbytes`` made by ``whole``: counted once it is ``sent``."""
        self._in_packs[id(pack)] = self._in_packs.get(id(pack), 0) + nbytes

    def sent(self, pack: Pack) -> None:
        """``pack`` was handed to its write: its copies wait for it like a chunk's."""
        nbytes = self._in_packs.pop(id(pack), 0)
        if nbytes:
            self.queued(nbytes, (pack.holder, 0))

    def queued(self, nbytes: int, slot: Slot) -> None:
        self._waiting.append((nbytes, slot))
        self._bytes += nbytes

    def _make_room(self, nbytes: int) -> None:
        while self._waiting and self._bytes + nbytes > self.limit:
            size, (holder, _index) = self._waiting.popleft()
            if not holder:  # still in the batch being gathered
                self.batches.flush()
            holder[0].result()
            self._bytes -= size
