"""Every error ckptflow raises on purpose derives from ``CkptflowError``; every one a
caller can receive is defined here (and exported by ``ckptflow``).

Messages say what went wrong, where (store URL, run, step, key) and what to do,
so an operator can act on a log line without reading the source.

The one rule every reader (restore, verify, validate, scrub, export, the catalog) applies
to what went wrong also lives here (``is_damage``, ``decoding``): only failing to read is
an outage; an error while decoding or checking bytes that were read is damage.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import zstandard


class CkptflowError(Exception):
    """Base class for all ckptflow errors."""


class InvalidNameError(CkptflowError, ValueError):
    """A run name, step or store key that could escape the store root or break keys."""


class ObjectNotFoundError(CkptflowError, KeyError):
    """A key that the store does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "object not found"


class CorruptChunkError(CkptflowError):
    """A chunk whose bytes do not match its content address or whose header is unreadable."""


class ManifestError(CkptflowError):
    """A manifest or rank record that is missing, unparsable or fails its checksum."""


class RecordTooLargeError(ManifestError):
    """A manifest or rank record larger than any ckptflow writes: refused unread."""


class NewerFormatError(CkptflowError):
    """A record a newer ckptflow sealed: its checksum verifies, and its ``format_version`` is
    above every one this ckptflow reads. That proves nothing about the checkpoint (a newer
    reader loads it), so it is never damage: restore stops rather than fall back past it, a
    save never moves it aside, GC does not sweep what it might reference, and validation
    records no verdict. The message says to upgrade."""


class CheckpointExistsError(CkptflowError):
    """A save to a step that already has a valid commit record."""


class WentPast(CkptflowError):
    """What a restore that raised went past first: ``skipped`` says why for each candidate
    it tried, ``passed_over`` why each checkpoint its selector did not accept was none (the
    recovery record keeps both)."""

    def __init__(
        self,
        message: str,
        skipped: list[tuple[int, str]] | None = None,
        *,
        passed_over: list[tuple[int, str]] | None = None,
    ):
        super().__init__(message)
        self.skipped = skipped or []
        self.passed_over = passed_over or []


class NoValidCheckpointError(WentPast):
    """Restore found nothing it could load (``WentPast`` says why for each checkpoint)."""


class StateMismatchError(WentPast):
    """The state passed to ``restore`` does not have the checkpoint's structure: the
    caller's side, not a damaged checkpoint (restore falls back on damage only; a tensor
    ``load`` cannot allocate is a ``HostMemoryError``). ``skipped``: newer checkpoints it
    fell back past first, as damaged (the state may fit those: then the damage, not the
    state, is why nothing was restored)."""


class UnsupportedStateError(CkptflowError, TypeError):
    """A state value that cannot be stored without pickle."""


class StoreError(CkptflowError):
    """A store operation that still failed after the backend's bounded retries.

    The message names the operation, the object's full URL and the last failure, so a
    log line says which bucket/key to look at and whether to retry or fix permissions.
    """


class PartialRestoreError(CkptflowError):
    """A restore failed after every chunk had verified, while it read them into place (an
    I/O error, or a chunk damaged in the moment between the two passes): some tensors of
    ``state`` already hold the checkpoint's values. Restore again (it verifies everything
    afresh and falls back past damage) or rebuild the state; never train on it as it is."""


class StoreUnavailableError(WentPast, StoreError):
    """A store that did not answer (5xx, throttling, timeouts, resets) through every retry,
    or that could not be read at all. It proves nothing about the checkpoint: restore
    raises it instead of falling back to an older one. Raised by a restore that stopped so,
    ``WentPast`` says what it went past first: the steps before the stop were settled."""


class ColdObjectError(StoreUnavailableError):
    """An object in a cold storage class (S3 Glacier / Deep Archive) that must be restored
    (thawed) before it can be read; the message says how. Unreadable like an outage, so it
    proves nothing and restore never falls back past it; unlike an outage, waiting does not
    end it: it stays cold until someone requests a thaw, which takes hours, so nothing
    retries it (``retrying_may_help``)."""


class SymlinkError(StoreError):
    """A symbolic link below a local store's root: never followed (see ``store.local``)."""


class StoreFullError(StoreError):
    """The store's filesystem or quota is full; ``needed`` bytes did not fit."""

    def __init__(self, message: str, needed: int = 0):
        super().__init__(message)
        self.needed = needed


class ObjectTooLargeError(CkptflowError):
    """An object larger than its record says it can be, refused before it is read whole."""


class StoreNotFoundError(CkptflowError):
    """A store root that does not exist, opened by a command that only inspects."""


class RegistryError(CkptflowError):
    """A model alias or version that does not exist, or a move that cannot be made."""


class MirrorError(CkptflowError):
    """A model registry mirror (MLflow) that could not be brought up to date after its
    retries. ckptflow's own registry is unchanged by it and stays the source of truth:
    syncing again (idempotent) finishes the mirror. ``retry``: whether syncing again soon
    may (MLflow or the store did not answer); False when it repeats until someone acts (MLflow
    refused, a damaged registry record, another registry mirroring into that model)."""

    def __init__(self, message: str, *, retry: bool = False):
        super().__init__(message)
        self.retry = retry


class PromotionError(CkptflowError):
    """A promotion that cannot be made; nothing was written."""


class HostMemoryError(WentPast):
    """This host ran out of memory while decoding or checking bytes that were read, or could
    not allocate a tensor ``load`` must create whose chunks can hold it, each allocation
    within what the manifest allows: not damage, so nothing falls back or is moved. From a
    restore, ``WentPast`` says what it skipped as damaged first."""


class ExpireError(CkptflowError):
    """A delete failed while expiring a checkpoint: it (or part of it) is still there."""


class RetentionError(CkptflowError):
    """Retention could not start expiring (another retention, or promotions in flight); nothing was expired."""


class LossyCopyError(CkptflowError):
    """A lossy archive copy was about to be restored without ``allow_lossy=True``."""


class FailedValidationError(CkptflowError):
    """The commit's validation verdict failed: part of it was proved damaged, so nothing
    reads it unless its caller opted in (``catalog.verdicts.check_not_failed``)."""


class EvaluatorError(CkptflowError):
    """A run's evaluator (anyone's code) could not be loaded or raised: the checkpoint's
    evaluation failed, not its store or its bytes, and a retry would only repeat it."""


class DcpFormatError(CkptflowError):
    """A DCP directory that is not one, is damaged, or holds what ckptflow will not unpickle."""


DAMAGE = (ManifestError, CorruptChunkError)  # the errors that prove a checkpoint is damaged

# What decoding or checking bytes that were already read raises when they are bad: a zstd
# frame that does not decode, a length that does not unpack, a record the parser chokes on.
# Not MemoryError: every allocation is bounded by what the manifest and the bytes stored can
# hold, so running out of memory says the host is short of it, not that the bytes are bad.
MALFORMED: tuple[type[Exception], ...] = (
    ValueError, TypeError, LookupError, ArithmeticError, RecursionError, struct.error, zstandard.ZstdError,
)  # fmt: skip
# what a check of a checkpoint reports as a finding, sorted by ``is_damage``
CHECK_ERRORS: tuple[type[Exception], ...] = (CkptflowError, OSError, MemoryError, *MALFORMED)


def is_damage(error: BaseException) -> bool:
    """Whether ``error`` proves the checkpoint it was raised for is damaged.

    Our own errors say so themselves (``DAMAGE``); a store error or an ``OSError`` is a
    failure to read (an outage, a denied or cold object), which proves nothing; any other
    error in ``MALFORMED`` was raised while decoding or checking bytes that were read, so
    those bytes are bad. This is the only place the line is drawn."""
    if isinstance(error, CkptflowError):
        return isinstance(error, DAMAGE)
    return isinstance(error, MALFORMED) and not isinstance(error, OSError)


def retrying_may_help(error: BaseException) -> bool:
    """Whether the same work, merely tried again minutes later, may succeed: a store that did
    not answer may answer then; a cold object stays cold until someone thaws it (hours), so
    a retry only repeats the failure and delays the thaw instruction reaching a person."""
    return isinstance(error, StoreUnavailableError) and not isinstance(error, ColdObjectError)


@contextlib.contextmanager
def decoding(what: str, damage: type[CkptflowError] = CorruptChunkError) -> Iterator[None]:
    """Decode or check bytes that were read: an error of ours or of the store passes
    through as it is (a delta's base is read while decoding), any other error in
    ``MALFORMED`` becomes ``damage`` ("``what``: the error")."""
    try:
        yield
    except CkptflowError:
        raise
    except MemoryError as e:
        raise HostMemoryError(
            f"{what.split(' is ')[0]}: not enough host memory to decode it" + (f" ({e})" if str(e) else "")
            + "; nothing shows its bytes are damaged: free memory (or lower the threads or restore_buffer_bytes), "
            "then try again"
        ) from None  # fmt: skip
    except MALFORMED as e:
        if isinstance(e, OSError):
            raise
        name = "struct.error" if isinstance(e, struct.error) else type(e).__name__
        raise damage(f"{what}: {name}" + (f": {e}" if str(e) else "")) from None
