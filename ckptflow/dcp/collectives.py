"""The few collectives save and restore need, as no-ops without a process group."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from ckptflow.errors import CkptflowError

T = TypeVar("T")


def job_timeout() -> timedelta | None:
    """The timeout the job gave ``init_process_group``, so the groups ckptflow makes wait
    as long as the job's own collectives, not torch's gloo default (30 minutes). None where
    the job gave none (its timeout is its backend's default: NCCL's 10 minutes were chosen
    for GPU collectives, while ckptflow's wait for storage, a rank verifying a checkpoint
    or writing its shard), and gloo's default applies. Read from the default group's
    backend options, which torch does not expose publicly: None where they do not say."""
    defaults = {t for t in (default_pg_timeout, default_pg_nccl_timeout) if isinstance(t, timedelta)}
    try:
        default = dist.distributed_c10d._get_default_group()
        for device in default._device_types:
            timeout = default._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return None if timeout in defaults else timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    return None


def new_gloo_group(ranks: list[int] | None = None, *, local_synchronization: bool = False) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` (all by default) with the job's timeout (``job_timeout``).
    Gloo whatever the job's backend: ckptflow's collectives carry small Python objects."""
    group = dist.new_group(
        ranks=ranks, backend="gloo", timeout=job_timeout(), use_local_synchronization=local_synchronization
    )
    assert group is not None  # every caller is in ``ranks``
    return group


class Group:
    """``local``: this process on its own, also inside a torch.distributed job (for a
    framework that checkpoints from one rank only: no collective would ever complete)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, local: bool = False):
        self.active = not local and dist.is_available() and dist.is_initialized()
        self.pg = process_group
        if self.active and self.pg is None:
            # A dedicated gloo group keeps checkpoint collectives (also those of async
            # saves in a background thread) apart from the training job's collectives.
            self.pg = new_gloo_group()
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

    def decided_on_rank_0(self, decide: Callable[[], T], what: str) -> T:
        """Rank 0's answer from ``decide`` on every rank, or its exception raised on every
        rank at once: raised on rank 0 alone, it would leave the others waiting in the
        broadcast until the group's timeout. Any exception counts, not only ckptflow's;
        one of another kind travels as text (it may not pickle), and rank 0 raises its
        own. ``what`` completes "rank 0 could not …" in the others' message."""
        answer: T | None = None
        error: CkptflowError | None = None
        own: Exception | None = None
        if self.rank == 0:
            try:
                answer = decide()
            except CkptflowError as e:
                error = own = e
            except Exception as e:
                own = e
                error = CkptflowError(
                    f"rank 0 could not {what} ({type(e).__name__}: {e}; its traceback is in rank 0's log), so "
                    "no rank went on"
                )
        answer, error = self.broadcast((answer, error))
        if error is not None:
            raise own or error
        return answer
