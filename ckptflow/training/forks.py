"""A ``Checkpointer`` inherited by a forked child: its own threads and no save of the parent's.

A fork copies the pool's record of its worker threads but not the threads, so every task the
child submitted waited for ever (a save, a restore, even ``close()`` of a ``with`` block), and
the async save in flight, which only the parent's threads can finish, hung the child's
``wait()``. In the child each Checkpointer gets a fresh pool (its threads start on first use)
and forgets the parent's save in flight: the parent commits it, the child must not wait for it.
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol


class Forkable(Protocol):
    """What of a ``Checkpointer`` a fork renews (a protocol: the checkpointer imports this module)."""

    pool: ThreadPoolExecutor
    _pending: Any


_LIVE: weakref.WeakSet[Forkable] = weakref.WeakSet()


def follow(checkpointer: Forkable) -> None:
    """Renew ``checkpointer``'s threads in any child forked while it lives."""
    _LIVE.add(checkpointer)


def _in_child() -> None:
    for checkpointer in list(_LIVE):
        checkpointer.pool = ThreadPoolExecutor(checkpointer.pool._max_workers, thread_name_prefix="ckptflow")
        checkpointer._pending = None


os.register_at_fork(after_in_child=_in_child)
