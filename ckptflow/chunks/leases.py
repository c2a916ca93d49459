"""Save leases and the GC lock: the handshake that keeps GC from deleting a chunk that a
save is reusing at that very moment, and that never lets a dead process block the other.
The same handshake keeps retention from expiring a checkpoint that a promotion is
publishing (``PROMOTIONS``): each pair is a ``LockFamily``.

The grace period alone cannot cover that case: GC lists a chunk as old and unreferenced,
a save then finds the same content already stored and reuses it, and GC deletes it.
So a save takes a lease before any of its ranks looks at a chunk (its coordinator, when
planning: ``dcp.commit_lease``) and GC takes a lock before it lists anything; each then
checks for the other. On a store with read-after-write consistency (local disks, S3) one
side always sees the other: a save waits while GC holds the lock, and GC waits (then gives
up and says so) while a save holds a lease.

Both are kept alive by a heartbeat: the holder renews its object every ``HEARTBEAT``
seconds from a background thread, and one not renewed for ``DEAD_AFTER`` seconds was
left by a process that died (SIGKILL, a lost node). A dead lease is cleared by the next
GC and reported; a dead GC lock is taken over by the next GC with a compare-and-swap, so
two GCs can never both hold it, and a save stops waiting for it. The lock's renewal is a
compare-and-swap too: a GC that finds its lock taken over stops before deleting more.
Every body the lock's holder writes carries its one holder token, so a renewal or a
release whose outcome is unknown (the write, or the read of the new version after it,
failed) reads the lock back: its own token means it still holds the lock (it adopts the
version it reads, renews, and deletes it on release); only another token, or no lock,
means it was taken over; an outage alone never does (a release retries it a few times).
Liveness compares the object's modification time with this machine's clock, so the
machines sharing a store need clocks within a few seconds of each other (NTP).

A lease also says which process holds it (``ckptflow.chunks.owners``): the machine (the
kernel's boot id and the PID namespace, so a pid means the same process only where both
match), the pid and the process's start time (``/proc/<pid>/stat`` field 22, so a pid reused by another process
is not mistaken for it). GC on that machine clears the lease of a holder that is gone
(SIGKILL, the OOM killer) at once; elsewhere only ``DEAD_AFTER`` bounds it. The GC lock says
the same, so a save on the machine of a GC that was killed stops waiting for it at once,
and the next GC there takes the lock over at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from ckptflow.chunks import owners
from ckptflow.errors import (
    CkptflowError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PromotionError,
    RetentionError,
    StoreUnavailableError,
)
from ckptflow.store.base import ObjectInfo, Store


@dataclass(frozen=True)
class LockFamily:
    """Many shared holders (each with a lease under ``leases``) and one exclusive holder (the
    object ``lock``) that wait for each other; ``shared`` and ``exclusive`` name them in
    messages."""

    leases: str
    lock: str
    shared: str
    exclusive: str
    shared_error: type[CkptflowError] = CkptflowError  # a lease holder waited too long for the lock
    exclusive_error: type[CkptflowError] = CkptflowError  # another holds the lock


# a GC still alive past the wait is a store busy for now, not a failed save: retried as an outage
SAVES = LockFamily("locks/leases/", "locks/gc.json", "save", "garbage collection", StoreUnavailableError)
PROMOTIONS = LockFamily(
    "locks/promotions/", "locks/retention.json", "promotion", "retention", PromotionError, RetentionError
)
LEASES = SAVES.leases
GC_LOCK = SAVES.lock
LOCKS = (SAVES.lock, PROMOTIONS.lock)  # a version taken aside is one its holder gave up (settle_interrupted_deletes)
HEARTBEAT = 5.0  # seconds between renewals
DEAD_AFTER = 30.0  # not renewed for this long: its holder died
SAVE_WAIT = 600.0  # how long a save waits for a live GC before it gives up
PROMOTION_WAIT = 600.0  # how long a promotion and a retention wait for each other
POLL = 0.05
RELEASE_TRIES = 4  # a release that meets an outage tries again after 0.05, 0.1 and 0.2 s
log = logging.getLogger("ckptflow")


def _version_if_ours(store: Store, key: str, token: str) -> str | None:
    """The version of the lock ``key`` if its body carries ``token`` (its holder's); None if
    another holder's body is there. ``ObjectNotFoundError`` if none is; an outage raises
    too: it proves neither."""
    try:
        body, version = store.get_versioned(key, 1 << 16)
    except ObjectTooLargeError:  # nothing this holder wrote
        return None
    return version if owners.token(body) == token else None


def age(info: ObjectInfo) -> float:
    """Seconds since ``info`` was last renewed, by this machine's clock."""
    return time.time() - info.mtime


def _elapsed() -> float:
    """Seconds on a clock that runs while this machine is suspended (Linux's CLOCK_BOOTTIME;
    elsewhere ``time.monotonic``). Others judge a holder's object by its age in wall-clock
    time; CLOCK_MONOTONIC, ``time.monotonic`` on Linux, stops while the machine sleeps, so a
    holder resumed after ``DEAD_AFTER`` would still trust an object others took for dead."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class Heartbeat:
    """Renews ``key`` every ``HEARTBEAT`` seconds until stopped. ``lost`` says whether the
    holder can no longer trust it holds ``key``: taken over, deleted, or not renewed for
    half of ``DEAD_AFTER`` (the store did not answer). It is lost for good, even once
    renewals succeed again, if another process may have judged it dead meanwhile (and gone
    on: a save past a GC lock, a GC sweeping a save's chunks): if the object may have grown
    older than ``DEAD_AFTER`` less a sixth of it (5 s, for clocks apart) between two
    renewals, from the start of the one before to the end of the one after. A single slow
    renewal no process could have judged dead loses nothing. Time suspended counts
    (``_elapsed``): the object aged meanwhile in the eyes of every other process.

    A lease is touched. An exclusive lock (``token``: its holder's, in every body it
    writes) is rewritten by compare-and-swap against ``version``, the one its holder last
    wrote. Where that is unknown (None: a write or its re-read failed, so whether the write
    landed is not known), the lock is read: the holder's token there means it still holds
    the lock, and it adopts that version; another token, or no lock, means taken over. An
    outage alone never does: it is retried at the next beat, and ``lost`` if it lasts."""

    def __init__(self, store: Store, key: str, *, what: str = "gc", token: str | None = None):
        self.store, self.key, self.what, self.token = store, key, what, token
        self.version: str | None = None
        self.renewed = _elapsed()  # when the last renewal ended
        self._good_start = self.renewed  # when it began: the object is no older than since then
        self.taken = False
        self.lapsed = False  # it may have looked dead to another process: lost for good
        if token is not None:
            try:
                self._adopt()
            except Exception as e:  # the holder took the lock; its version is read at the next beat
                log.warning("could not read %s/%s after taking it: %s", store.url, key, e)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckptflow-heartbeat-{key}", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self.taken or self.lapsed or _elapsed() - self.renewed > DEAD_AFTER / 2

    def _renewed(self, started: float) -> None:
        now = _elapsed()
        self.lapsed = self.lapsed or now - self._good_start > DEAD_AFTER * 5 / 6
        self._good_start, self.renewed = started, now

    def _run(self) -> None:
        while not self.taken and not self._stop.wait(HEARTBEAT):
            try:
                self._renew()
            except ObjectNotFoundError:
                self.taken = True
            except Exception as e:  # an outage: retried at the next beat, ``lost`` if it lasts
                log.warning("could not renew %s/%s: %s", self.store.url, self.key, e)

    def _renew(self) -> None:
        started = _elapsed()
        if self.token is None:  # a lease (or a lock on a store without compare-and-swap): only its age matters
            self.store.touch(self.key)
            self._renewed(started)
            return
        if self.version is None and not self._adopt():
            return
        expected, self.version = self.version, None  # unknown until the write and its re-read have answered
        if self.store.replace_if(self.key, owners.body(self.what, self.token), expected):
            self._renewed(started)
        self._adopt()  # the new version; if refused, the lock is another holder's or a late write of ours

    def _adopt(self) -> bool:
        """Read the lock: still this holder's (its token) → adopt its version; else taken."""
        try:
            self.version = _version_if_ours(self.store, self.key, self.token or "")
        except ObjectNotFoundError:
            self.version = None
        self.taken = self.version is None
        return not self.taken

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def save_lease(store: Store, timeout: float | None = None, *, work: str = SAVES.shared) -> Iterator[Heartbeat]:
    """Hold a lease for a save (on its coordinator from planning until its commit:
    ``dcp.commit_lease``) or other ``work`` writing chunks, named in the error of
    a wait that ran out; wait out a live GC first."""
    with shared_lease(store, SAVES, SAVE_WAIT if timeout is None else timeout, work=work) as beat:
        yield beat


@contextmanager
def shared_lease(store: Store, family: LockFamily, timeout: float, *, work: str = "") -> Iterator[Heartbeat]:
    """Hold a lease of ``family``, renewed while held. The lease is put first, then the lock
    looked at (so the exclusive holder, which does the opposite, always sees one of the
    two); a live lock is waited out without the lease, which it would be waiting for."""
    started = time.monotonic()
    while True:
        key = f"{family.leases}{uuid.uuid4().hex}.json"
        store.put_if_absent(key, owners.body(family.shared))
        try:
            locked = _live_lock(store, family)[0]
        except BaseException:
            store.delete(key)
            raise
        if locked is None:
            break
        store.delete(key)
        _wait_for_lock(store, family, timeout, started, work or family.shared)
    beat = Heartbeat(store, key)
    try:
        yield beat
    finally:
        beat.stop()
        store.delete(key)


def _lock_holder_gone(store: Store, family: LockFamily) -> bool:
    """Whether ``family``'s lock was left by a process on this machine that is gone."""
    try:
        return owners.gone(store.get_bounded(family.lock, 1 << 16))
    except (CkptflowError, OSError):  # released meanwhile, or unreadable: it proves nothing
        return False


def _live_lock(store: Store, family: LockFamily, checked: str | None = None) -> tuple[ObjectInfo | None, str | None]:
    """``family``'s lock if a live holder has it (not one left by a holder that died: not
    renewed for ``DEAD_AFTER``, or killed on this machine), and the lock version whose
    holder was looked at: passed back as ``checked``, a poll reads the lock only when it
    changes."""
    try:
        info = store.stat(family.lock)
    except ObjectNotFoundError:
        return None, checked
    if age(info) >= DEAD_AFTER:
        return None, checked
    if info.version != checked or checked is None:
        if _lock_holder_gone(store, family):
            return None, info.version
    return info, info.version


def _wait_for_lock(store: Store, family: LockFamily, timeout: float, started: float, work: str) -> None:
    """Until ``family``'s lock has no live holder; ``timeout`` s after ``started``, raise
    ``family.shared_error`` saying to try ``work`` again."""
    said = False
    checked: str | None = None
    while True:
        info, checked = _live_lock(store, family, checked)
        if info is None:
            return
        if not said and time.monotonic() - started > 1.0:
            log.warning("%s waiting for %s to finish on %s (%s, renewed %.0f s ago)",
                        family.shared, family.exclusive, store.url, family.lock, age(info))  # fmt: skip
            said = True
        if time.monotonic() - started > timeout:
            raise family.shared_error(
                f"{family.exclusive} has held {store.url}/{family.lock} for over {timeout:.0f} s and is still alive "
                f"(renewed within the last {DEAD_AFTER:.0f} s); wait for it to finish, or stop it, then try the "
                f"{work} again"
            )
        time.sleep(POLL)


@contextmanager
def gc_lock(store: Store) -> Iterator[Heartbeat]:
    """Exclusive lock for a GC sweep (see ``exclusive_lock``)."""
    with exclusive_lock(store, SAVES) as beat:
        yield beat


@contextmanager
def exclusive_lock(store: Store, family: LockFamily) -> Iterator[Heartbeat]:
    """``family``'s exclusive lock, renewed while held; a dead holder's lock is taken over
    by compare-and-swap, so of two that find it dead only one gets it. It does not wait
    for the leases: the holder does (``lease_listing.wait_for_leases``), once it holds the lock."""
    what, lock = family.exclusive, family.lock
    token = uuid.uuid4().hex
    try:
        refused = _acquire(store, family, owners.body(what, token))
    except BaseException:  # a write whose outcome is unknown may have taken the lock: if so, it goes
        if store.compare_and_swap:
            with suppress(Exception):
                _delete_if_ours(store, lock, token, None, tries=1)
        raise
    if refused is not None:
        raise family.exclusive_error(refused)
    beat = Heartbeat(store, lock, what=what, token=token if store.compare_and_swap else None)
    try:
        yield beat
    finally:
        beat.stop()
        _release(store, lock, beat)


def _acquire(store: Store, family: LockFamily, body: bytes) -> str | None:
    """Create ``family``'s lock with ``body``, or take it over from a dead holder; why not if
    another holds it (a store's error raises)."""
    what, lock = family.exclusive, family.lock
    if store.put_if_absent(lock, body):
        return None
    try:
        info = store.stat(lock)
        version = store.get_versioned(lock)[1] if store.compare_and_swap else None
    except ObjectNotFoundError:  # released in between: try once more
        taken = not store.put_if_absent(lock, body)
        return f"another {what} just took {store.url}/{lock}; run it again later" if taken else None
    if age(info) < DEAD_AFTER and not _lock_holder_gone(store, family):
        return (
            f"another {what} holds {store.url}/{lock} (renewed {age(info):.0f} s ago); "
            "run it again when that one has finished"
        )
    if not _take_over(store, lock, body, version):
        return f"another {what} just took over {store.url}/{lock}; run it again later"
    log.warning("took over %s/%s from a %s that died", store.url, lock, what)
    return None


def _release(store: Store, lock: str, beat: Heartbeat) -> None:
    """Delete the lock only while it is still this holder's. A holder whose renewals could
    not reach the store for ``DEAD_AFTER`` may have been taken over without its heartbeat
    seeing it yet; a plain delete would then remove the new holder's lock, and saves (or
    promotions) would stop waiting for a sweep (or an expiry) still at work."""
    if beat.taken:
        return
    if beat.token is None:  # no compare-and-swap: the holder's own lock is all it can delete
        store.delete(lock)
        return
    try:
        if not _delete_if_ours(store, lock, beat.token, beat.version):
            log.warning("%s/%s was taken over by another holder; left to it", store.url, lock)
    except (CkptflowError, OSError) as e:
        log.warning("could not release %s/%s (%s); it is free %.0f s after its last renewal",
                    store.url, lock, e, DEAD_AFTER)  # fmt: skip


def _delete_if_ours(store: Store, lock: str, token: str, version: str | None, *, tries: int = RELEASE_TRIES) -> bool:
    """Delete ``lock`` if its body carries ``token``: by ``version`` while that is the
    lock's, else by the version read now (``version`` unknown or stale: a renewal whose
    re-read failed). False if another holder's lock is there: it stays. An outage is
    tried ``tries`` times, then raised."""
    for attempt in range(tries):
        try:
            if version is None:
                version = _version_if_ours(store, lock, token)
                if version is None:
                    return False
            if store.delete_if(lock, version):
                return True
            version = None  # refused: changed since, so read it again
        except ObjectNotFoundError:  # gone: deleted by an attempt that raised after it landed
            return True
        except (CkptflowError, OSError):
            version = None  # whether a delete that raised deleted is unknown
            if attempt + 1 >= tries:
                raise
            time.sleep(POLL * 2**attempt)
    return False


def _take_over(store: Store, lock: str, body: bytes, version: str | None) -> bool:
    """Replace a dead holder's lock. With compare-and-swap only one of two doing this wins;
    a store without it falls back to delete + create-only put, which leaves a short race."""
    if store.compare_and_swap:
        return store.replace_if(lock, body, version)
    store.delete(lock)
    return store.put_if_absent(lock, body)
