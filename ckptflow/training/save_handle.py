"""What ``Checkpointer.save`` returns: the result of a save, or the handle of one in flight."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from ckptflow.catalog.checkpoints import CheckpointInfo
from ckptflow.dcp.failures import describe_causes, own_errors, unwrap_failures
from ckptflow.dcp.writer import CheckpointWriter
from ckptflow.format.manifest import Manifest

log = logging.getLogger("ckptflow")


@dataclass(frozen=True)
class SaveResult:
    step: int
    kind: str
    info: CheckpointInfo | None  # on the coordinator rank; None elsewhere


class SaveHandle:
    """An async save in flight. ``wait()`` returns its ``SaveResult`` or raises its error."""

    def __init__(self, future: Future, writer: CheckpointWriter, blocked_s: float):
        self._future, self._writer = future, writer
        self.step, self.kind = writer.spec.step, writer.spec.kind
        self.blocked_s = blocked_s  # how long the caller was held (host copy, and any wait for the previous save)
        self.error_reported = False
        future.add_done_callback(lambda _done: writer.lease.release())  # however the save ended
        _finish_before_exit(self)

    def done(self) -> bool:
        """Whether the save has finished (committed or failed): ``wait()`` would not block."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            with own_errors():
                self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the save's own failure (not a wait timeout): reported now,
                self.error_reported = True  # so Checkpointer.wait() must not raise it again, nor the exit
                _IN_FLIGHT.discard(self)
            raise
        manifest = self.manifest
        return SaveResult(
            step=self.step, kind=self.kind, info=CheckpointInfo.from_manifest(manifest) if manifest else None
        )

    @property
    def writer(self) -> CheckpointWriter:
        """The save's writer: what it found in each chunk region, for the next save."""
        return self._writer

    @property
    def manifest(self) -> Manifest | None:
        """What the save committed (on the coordinator rank, once it has)."""
        return self._writer.manifest


_IN_FLIGHT: set[SaveHandle] = set()
_IN_FLIGHT_LOCK = threading.Lock()
_hooked = False
# a forked child (a DataLoader worker) inherits the set but not the threads that finish its saves
os.register_at_fork(after_in_child=_IN_FLIGHT.clear)


def _finish_before_exit(handle: SaveHandle) -> None:
    """Keep ``handle`` until its save ends, so that a script whose last call is an async
    save (or that raises after one) still commits it: the interpreter's exit would
    otherwise stop the thread pools the save writes with, and the save would be lost."""
    global _hooked
    with _IN_FLIGHT_LOCK:
        if not _hooked:
            _hooked = True
            try:  # runs before concurrent.futures refuses new work at exit (its own hook, registered earlier)
                threading._register_atexit(_finish_in_flight)  # type: ignore[attr-defined]
            except AttributeError:  # not CPython: the latest an exit hook can run
                atexit.register(_finish_in_flight)
        _IN_FLIGHT.add(handle)
    handle._future.add_done_callback(lambda future: _forget_if_committed(handle, future))


def _forget_if_committed(handle: SaveHandle, future: Future) -> None:
    """A committed save needs nothing more at exit; a failed one is kept until its error is
    reported (``SaveHandle.wait``, which ``Checkpointer.wait`` calls), else the exit reports
    it: a save that failed while training went on, and was never waited for, was lost
    without a word."""
    if not future.cancelled() and future.exception() is None:
        _IN_FLIGHT.discard(handle)


def _finish_in_flight() -> None:
    """Wait for every async save in flight; a save lost unwaited ends the process with status 1.

    Exiting 0 would tell the scheduler the job succeeded with its last checkpoint lost: a
    launcher that restarts failed jobs (torchrun's ``--max-restarts``) resumes from the newest
    committed checkpoint and saves again. A script that means to go on after a failed save
    waits for it and handles the error; that save is not reported again here."""
    step = None  # the save being waited for
    lost = False
    try:
        for handle in sorted(_IN_FLIGHT, key=lambda h: h.step):
            if handle.error_reported:
                continue
            if not handle.done():
                step = handle.step
                log.warning("the process is exiting: waiting for the async save of step %d to commit", step)
            try:
                with own_errors():
                    handle._future.result()
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # DCP's CheckpointException is not an Exception
                _report_lost(handle, e)
                lost = True
    except KeyboardInterrupt:  # wherever it lands, the message above included
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the last message short
        for handle in list(_IN_FLIGHT):  # the atexit handlers run before the end: no save commits meanwhile
            handle._writer.abandoned = True
        saves = "the async saves in flight are" if step is None else f"the async save of step {step} is"
        log.warning("interrupted: %s abandoned, not committed", saves)
        _exit_now(128 + signal.SIGINT)
    if lost:  # after the interpreter joins the script's own threads, as at any exit; the
        atexit.register(_exit_lost)  # handler registered last runs first: it runs the others


def _report_lost(handle: SaveHandle, error: BaseException) -> None:
    """The exit's report of a save nobody learned had failed: which, where, why, what now."""
    spec = handle._writer.spec
    causes = describe_causes(unwrap_failures(error))
    log.error(
        "the async save of run %r step %d in %s failed and was not committed: %s; a restore resumes from "
        "the newest checkpoint committed before it: fix the cause, then save step %d again (the process "
        "exits with status 1; wait for an async save to handle its failure yourself)",
        spec.run,
        spec.step,
        handle._writer.chunks.store.url,
        causes,
        spec.step,
    )


def _exit_lost() -> None:
    """Status 1 for a lost save, once the script's threads were joined (``_finish_in_flight``)."""
    atexit.unregister(_exit_lost)
    _exit_now(1)


def _exit_now(status: int) -> None:
    """End the process at once. Returning from an exit hook would not: the interpreter's
    exit then joins the thread pools, whose queued chunk writes finish the save anyway, so
    a Ctrl-C at exit would still wait for all of it. Nothing is committed half: the commit
    is one atomic write, and the chunks already written are garbage for ``ckptflow gc``.

    ``os._exit`` skips the ``atexit`` handlers, which run only after this hook: they are run
    first (the script's own, a library's flush, multiprocessing's, which ends the daemonic
    children that otherwise outlived the process), with Ctrl-C working as at any exit: it
    cuts short the handler it lands in, and the next one runs."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        atexit._run_exitfuncs()
    except KeyboardInterrupt:  # after the last handler returned
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads
            pass
    os._exit(status)
