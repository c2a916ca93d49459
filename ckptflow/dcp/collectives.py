"""The few collectives restore needs, as no-ops without a process group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class Group:
    """``local``: this process on its own, also inside a torch.distributed job (for a
    framework that checkpoints from one rank only: no collective would ever complete)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, local: bool = False):
        self.active = not local and dist.is_available() and dist.is_initialized()
        self.pg = process_group
        if self.active and self.pg is None:
            # A dedicated gloo group keeps checkpoint collectives (also those of async
            # saves in a background thread) apart from the training job's collectives.
            self.pg = dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.pg) if self.active else 0
        self.world_size = dist.get_world_size(self.pg) if self.active else 1

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj]
        assert self.pg is not None  # set whenever the group is active
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, src), group=self.pg)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out
