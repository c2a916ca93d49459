"""Failures inside torch.distributed.checkpoint, and which of them prove damage.

DCP wraps every rank's failure as ``rank -> (exception, traceback)`` in a
``CheckpointException`` that derives from ``BaseException`` (``except Exception`` does
not catch it). Restore needs the causes, each judged by ``errors.is_damage``: a hash
mismatch, a malformed record or any error while decoding bytes that were read proves the
checkpoint is damaged (fall back to an older one); failing to read only says the store
could not be read (stop). ``agree`` combines every rank's verdict into one, and
``ReadAborted`` carries the verdict the ranks agreed on out of the reader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ckptflow.dcp.collectives import Group
from ckptflow.errors import CkptflowError, ColdObjectError, HostMemoryError, NewerFormatError, is_damage


@dataclass(frozen=True)
class Failure:
    """Why a candidate could not be loaded. ``damage``: proof the checkpoint is bad (fall
    back to an older one); otherwise the store could not be read (stop)."""

    message: str
    _: KW_ONLY
    damage: bool
    cold: bool = False  # the store cannot be read until objects are thawed
    mismatch: bool = False  # the live state does not have the checkpoint's structure: the caller's error
    partial: bool = False  # failed while reading into place: the live state is already partly overwritten
    newer: bool = False  # a record a newer ckptflow wrote: upgrade to load it (not damage, no fallback)
    memory: bool = False  # this host ran out of memory (not damage, no fallback)
    committed_again: bool = False  # not the commit the selector accepted: not a candidate (restore passes it over)


class IntoPlaceFailed(CkptflowError):
    """Reading verified chunks into the caller's tensors failed (``Failure.partial``).

    Private control flow, not in ``ckptflow.errors``: the reader raises it inside DCP's
    load, and the readers' callers (restore, export) judge it with ``failure_of`` and
    raise an error of ``ckptflow.errors`` instead (restore: ``PartialRestoreError``)."""


class ReadAborted(CkptflowError):
    """The ranks agreed that a checkpoint cannot be loaded; ``failure`` says why.

    Private control flow, not in ``ckptflow.errors``: it carries the agreed verdict out
    of DCP's load to ``failure_of``; restore and export raise an error of
    ``ckptflow.errors`` for that verdict instead."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure

    def __reduce__(self) -> tuple:  # DCP pickles every rank's exception to gather them
        return (type(self), (self.failure,))


def unwrap_failures(error: BaseException) -> list[BaseException]:
    """The underlying causes of ``error`` (each rank's, for a ``CheckpointException``)."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and isinstance(failures, dict) and failures:
        return [c for _, f in sorted(failures.items()) for c in unwrap_failures(_cause(f))]
    return [error]


def _cause(failure: Any) -> BaseException:
    return failure[0] if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException) else failure


def describe(error: BaseException) -> str:
    """``error`` in a line, with its notes (``own_errors`` notes other ranks' causes on it)."""
    text = (
        (str(error) or type(error).__name__) if isinstance(error, CkptflowError) else f"{type(error).__name__}: {error}"
    )
    return "; ".join([text, *getattr(error, "__notes__", ())])


def describe_causes(causes: list[BaseException]) -> str:
    """Each distinct cause once (every rank often fails alike), in one line."""
    return "; ".join(dict.fromkeys(describe(c) for c in causes))


def failure_of(error: BaseException) -> Failure:
    """The verdict an exception carries: damage only if every cause proves damage."""
    causes = unwrap_failures(error)
    for cause in causes:
        if isinstance(cause, ReadAborted):
            return cause.failure
    message = describe_causes(causes)
    if any(isinstance(c, IntoPlaceFailed) for c in causes):
        return Failure(message, damage=False, partial=True)
    damage = all(is_damage(c) for c in causes)
    return Failure(
        message, damage=damage, cold=not damage and any(isinstance(c, ColdObjectError) for c in causes),
        newer=not damage and any(isinstance(c, NewerFormatError) for c in causes),
        memory=not damage and any(isinstance(c, (MemoryError, HostMemoryError)) for c in causes),
    )  # fmt: skip


@contextlib.contextmanager
def own_errors() -> Iterator[None]:
    """Re-raise our own error from inside DCP's ``CheckpointException`` (a ``BaseException``,
    which ``except Exception`` misses): a Ctrl-C that DCP caught in a writer thread if there
    is one (the CLI reports it as interrupted), else the lowest failing rank's error, with
    the other ranks' causes added as a note. Several ranks fail at once as a rule (a store
    that is down is down for all), and every rank gets the same causes, so every rank
    raises an error of the same kind."""
    try:
        yield
    except CheckpointException as e:
        causes = unwrap_failures(e)
        if not causes or not all(isinstance(c, (Exception, KeyboardInterrupt)) for c in causes):
            raise
        first = next((c for c in causes if isinstance(c, KeyboardInterrupt)), causes[0])
        others = describe_causes([c for c in causes if c is not first and describe(c) != describe(first)])
        note = f"other ranks failed too: {others}"
        # Python 3.11+ (3.10 tells the first cause alone); a handle's second wait() raises it again
        add_note = getattr(first, "add_note", None)
        if others and add_note is not None and note not in getattr(first, "__notes__", ()):
            add_note(note)
        raise first from None


def agree(group: Group, failure: Failure | None) -> Failure | None:
    """Every rank's verdict combined: any failure fails all ranks; any failure that is not
    damage makes the combined one not damage (one rank unable to read stops everyone)."""
    gathered = group.all_gather(failure)
    failures = [f for f in gathered if f]
    if not failures:
        return None
    fatal = [f for f in failures if not f.damage and not f.mismatch]
    chosen = [f for f in failures if f.partial] or fatal or [f for f in failures if f.mismatch] or failures
    message = "; ".join(dict.fromkeys(f.message for f in chosen))
    if chosen[0].mismatch and group.world_size > 1:
        message = _by_rank(gathered, chosen)
    return Failure(
        message, damage=chosen[0].damage, cold=any(f.cold for f in fatal), mismatch=chosen[0].mismatch,
        partial=chosen[0].partial, newer=any(f.newer for f in fatal), memory=any(f.memory for f in fatal),
        committed_again=all(f.committed_again for f in chosen),
    )  # fmt: skip


def _by_rank(gathered: list[Failure | None], chosen: list[Failure]) -> str:
    """Each mismatch message after the ranks whose state it describes ("rank 1 of 2: ..."):
    a state is each rank's own, and a rank whose state fits raises it too, so the
    message says whose state to fix."""
    ranks: dict[str, list[int]] = {}
    for rank, f in enumerate(gathered):
        if f is not None and f in chosen:
            ranks.setdefault(f.message, []).append(rank)
    world = len(gathered)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} of {world}: {message}"
        for message, rs in ranks.items()
    )
