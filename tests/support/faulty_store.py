"""Test doubles: a ``Store`` wrapper that counts operations, injects faults, and pauses.

``FaultyStore(inner)`` delegates every call to ``inner``. Mutating operations
(``put_if_absent``, ``replace``, ``delete``, ``touch``) are numbered from 0 in the order
they start (reads too, with ``count_reads=True``); the counter is guarded by a lock
because a save writes chunks from a thread pool.

Faults: ``arm(n, when="before"|"after", sticky=True)`` makes operation number ``n``
raise ``InjectedFault`` (an ``OSError``) -- before it touches the inner store, or after
it completed (the caller never learns it succeeded). ``sticky`` makes every later
operation fail too, which is what a crashed process looks like to the store: nothing
after the crash point happens.

``locked``, ``settle_interrupted_deletes`` and the other optional capabilities whose absence
would change what a caller does (``batch``, ``stale_temp_files``, ``delete_temp``,
``request_thaw``, and the flags ``cheap_reread``, ``writes_cold``, ``can_thaw``, ``locks_exclude``)
go straight to ``inner``, unnumbered and never faulted: through the defaults, gc never swept a
stale temp file. ``metadata_store`` is this store where ``inner``'s is ``inner`` itself, else
``inner``'s (unfaulted). The reads the defaults build on ``get`` (``scan``, ``get_into``,
``read_head``, ``get_bounded``) stay numbered and faultable.

Pauses: ``pause_before(op, key_predicate)`` returns a ``PausePoint``; the first call
matching it blocks until ``PausePoint.release()`` (``reached`` is set while it waits).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator

from ckptflow.store.base import Buffers, ObjectInfo, SettledDeletes, Store

MUTATING = ("put_if_absent", "replace", "delete", "touch")
READS = ("get", "list", "stat", "exists")


class InjectedFault(OSError):
    """The error a FaultyStore raises at the armed operation."""


class PausePoint:
    def __init__(self, op: str, predicate: Callable[[str], bool], timeout: float):
        self.op, self.predicate, self.timeout = op, predicate, timeout
        self.reached = threading.Event()
        self._go = threading.Event()
        self.key: str | None = None
        self.fired = False

    def release(self) -> None:
        self._go.set()

    def _wait(self, key: str) -> None:
        self.key = key
        self.reached.set()
        if not self._go.wait(self.timeout):
            raise InjectedFault(f"pause at {self.op}({key}) was never released")


class FaultyStore(Store):
    def __init__(self, inner: Store, *, count_reads: bool = False):
        self.inner = inner
        self.url = inner.url
        # the flags of what inner can do, which a test may set otherwise
        self.cheap_reread, self.writes_cold = inner.cheap_reread, inner.writes_cold
        self.can_thaw, self.locks_exclude = inner.can_thaw, inner.locks_exclude
        self.count_reads = count_reads
        self._lock = threading.Lock()
        self.ops = 0
        self.log: list[tuple[int, str, str]] = []  # (number, op, key)
        self.faults: list[tuple[int, str, str]] = []  # (number, op, key) of raised faults
        self._fail_at: int | None = None
        self._when = "before"
        self._sticky = True
        self._pauses: list[PausePoint] = []
        self.fail_if: Callable[[str, str], bool] = lambda op, key: False  # (op, key) -> raise before it runs

    # ---- control --------------------------------------------------------------------
    def arm(self, n: int, *, when: str = "before", sticky: bool = True) -> None:
        if when not in ("before", "after"):
            raise ValueError(when)
        with self._lock:
            self._fail_at, self._when, self._sticky = n, when, sticky

    def disarm(self) -> None:
        with self._lock:
            self._fail_at = None

    def reset_counts(self) -> None:
        with self._lock:
            self.ops = 0
            self.log.clear()
            self.faults.clear()

    def pause_before(
        self, op: str, predicate: Callable[[str], bool] = lambda key: True, timeout: float = 30.0
    ) -> PausePoint:
        point = PausePoint(op, predicate, timeout)
        with self._lock:
            self._pauses.append(point)
        return point

    def mutating_log(self) -> list[tuple[int, str, str]]:
        with self._lock:
            return [entry for entry in self.log if entry[1] in MUTATING]

    # ---- plumbing -------------------------------------------------------------------
    def _begin(self, op: str, key: str) -> tuple[bool, bool]:
        """Number this op; (raise before it runs, raise after it runs)."""
        pause = None
        with self._lock:
            for point in self._pauses:
                if not point.fired and point.op == op and point.predicate(key):
                    point.fired = True
                    pause = point
                    break
        if pause is not None:
            pause._wait(key)
        with self._lock:
            if op not in MUTATING and not self.count_reads:
                return False, False
            n = self.ops
            self.ops += 1
            self.log.append((n, op, key))
            armed = self._fail_at
            if armed is None:
                return False, False
            hit = n == armed or (self._sticky and n > armed)
            if not hit:
                return False, False
            before = self._when == "before" or n > armed
            if before:
                self.faults.append((n, op, key))
            return before, not before

    def _call(self, op: str, key: str, fn: Callable, *args, **kwargs):
        if self.fail_if(op, key):
            raise InjectedFault(f"injected fault in {op}({key})")
        fail_before, fail_after = self._begin(op, key)
        if fail_before:
            raise InjectedFault(f"injected fault before {op}({key})")
        result = fn(*args, **kwargs)
        if fail_after:
            with self._lock:
                self.faults.append((-1, op, key))
            raise InjectedFault(f"injected fault after {op}({key}) completed")
        return result

    # ---- Store interface ------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._call("get", key, self.inner.get, key)

    def put_if_absent(self, key: str, data: Buffers) -> bool:
        return self._call("put_if_absent", key, self.inner.put_if_absent, key, data)

    def replace(self, key: str, data: Buffers) -> None:
        return self._call("replace", key, self.inner.replace, key, data)

    def list(self, prefix: str, *, recursive: bool = True) -> Iterator[ObjectInfo]:
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix, recursive=recursive))))

    def list_after(self, prefix: str, start_after: str = "", *, roll_up: str = "") -> Iterator[ObjectInfo]:
        listed = lambda: list(self.inner.list_after(prefix, start_after, roll_up=roll_up))
        return iter(self._call("list_after", prefix, listed))

    def delete(self, key: str) -> None:
        return self._call("delete", key, self.inner.delete, key)

    def stat(self, key: str) -> ObjectInfo:
        return self._call("stat", key, self.inner.stat, key)

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self.inner.exists, key)

    def touch(self, key: str) -> None:
        return self._call("touch", key, self.inner.touch, key)

    @property
    def compare_and_swap(self) -> bool:  # type: ignore[override]
        return self.inner.compare_and_swap

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.batch()

    def stale_temp_files(self, older_than: float) -> Iterator[ObjectInfo]:
        return self.inner.stale_temp_files(older_than)

    def delete_temp(self, name: str) -> None:
        return self.inner.delete_temp(name)

    def metadata_store(self) -> Store:
        metadata = self.inner.metadata_store()
        return self if metadata is self.inner else metadata

    def request_thaw(self, key: str, *, days: int = 1, tier: str = "Standard") -> bool:
        return self.inner.request_thaw(key, days=days, tier=tier)

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        return self._call("get", key, self.inner.get_versioned, key, limit)

    def version_and_size(self, key: str) -> tuple[str, int]:
        return self._call("get", key, self.inner.version_and_size, key)

    def delete_if(self, key: str, expected: str) -> bool:
        return self._call("delete", key, self.inner.delete_if, key, expected)

    def locked(self, name: str):
        return self.inner.locked(name)

    def settle_interrupted_deletes(self, *, locks: Collection[str] = (), dry_run: bool = False) -> SettledDeletes:
        return self.inner.settle_interrupted_deletes(locks=locks, dry_run=dry_run)

    def replace_if(self, key: str, data: Buffers, expected: str | None) -> bool:
        return self._call("replace", key, self.inner.replace_if, key, data, expected)
