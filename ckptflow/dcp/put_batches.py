"""Chunk writes handed to a thread pool in batches (``CheckpointWriter``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Slot = tuple[list, int]  # (a holder of the batch's future, once submitted; the job's place in the batch)


class PutBatches:
    """Chunk writes handed to the pool in batches of about one chunk's bytes and at most
    ``jobs`` writes: under GIL contention a ``submit`` holds the saving thread ~0.2 ms, which
    at one per chunk was a quarter of an incremental save of a state of 1,200 small tensors.
    A chunk of full size is a batch of its own, so large tensors keep one task per chunk. A
    batch's writes run one after another, each waiting on its store: a few per batch on a
    local disk (an fsync), one on S3 (a request)."""

    def __init__(self, pool: ThreadPoolExecutor, put: Callable, limit: int, *, jobs: int):
        self.pool, self.put, self.limit, self.jobs = pool, put, limit, jobs
        self.submitted: list[Future] = []
        self._jobs: list[tuple] = []
        self._holder: list[Future] = []  # gets the batch's future when it is submitted
        self._bytes = 0

    def add(self, piece: memoryview, *job: Any) -> Slot:
        """Queue a ``put(piece, *job)``; where its result will be: (holder, slot)."""
        handle = (self._holder, len(self._jobs))
        self._jobs.append((piece, *job))
        self._bytes += len(piece)
        if self._bytes >= self.limit or len(self._jobs) >= self.jobs:
            self.flush()
        return handle

    def flush(self) -> None:
        if self._jobs:
            jobs = self._jobs
            future = self.pool.submit(lambda: [self.put(*job) for job in jobs])
            self._holder.append(future)
            self.submitted.append(future)
            self._jobs, self._holder, self._bytes = [], [], 0


class _Ran:
    """A job that already ran, on the calling thread: holds its result as a batch's future
    would (a ``Future`` builds a lock and a condition; an incremental save makes one of
    these per untouched region)."""

    __slots__ = ("values",)

    def __init__(self, value: Any):
        self.values = [value]

    def result(self) -> list:
        return self.values


def ready(value: Any) -> Slot:
    """The slot of a job that already ran, on the calling thread."""
    return [_Ran(value)], 0


def result(slot: Slot) -> Any:
    holder, index = slot
    return holder[0].result()[index]
