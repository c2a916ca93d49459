"""The names-only half of the catalog: which runs and step directories a store holds.

A listing reads no record, so its cost is listings alone (one per run); ``catalog``
reads the commit records it finds. Both halves report what cannot be looked at as a
``Problem`` on its own line (classified once, by ``problem_from``), never an exception
that ends a whole listing.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass

from ckptflow.errors import (
    CkptflowError,
    ColdObjectError,
    InvalidNameError,
    NewerFormatError,
    RecordTooLargeError,
    StoreError,
    SymlinkError,
    is_damage,
)
from ckptflow.format import layout as fmt
from ckptflow.store.base import ObjectInfo, Store


@dataclass(frozen=True)
class Problem:
    """A run or checkpoint that cannot be read, and why. ``kind`` is one of ``KINDS``;
    those in ``UNREAD`` say it could not be looked at (it might be fine; ``newer``: a
    newer ckptflow wrote it), the others prove damage or a store layout ckptflow never
    writes."""

    run: str
    step: int | None
    kind: str
    message: str

    KINDS = (
        "corrupt", "too_big", "cold", "denied", "symlink", "loop", "unavailable", "bad_name", "not_a_directory",
        "unreadable", "newer",
    )  # fmt: skip
    UNREAD = ("cold", "denied", "symlink", "loop", "unavailable", "unreadable", "newer")

    PASSING = ("cold", "denied", "unavailable", "newer")  # unread for a reason that passes with time or action

    @property
    def could_not_read(self) -> bool:
        """Nothing was proved: retry, thaw or fix access, never record the checkpoint as bad."""
        return self.kind in self.UNREAD

    @property
    def may_read_later(self) -> bool:
        """Unread for a reason that passes (an outage, a thaw, access granted, an upgrade), not
        one a retry of the same layout meets again (a symlink, a loop, an unknown error)."""
        return self.kind in self.PASSING

    def __str__(self) -> str:
        where = f"run {self.run}" + ("" if self.step is None else f" step {self.step}")
        return f"{where}: {self.message}"


RANKS_ROLLED = "/ranks/"  # what ``listing(manifests_only=True)`` rolls a step's rank records up at


@dataclass(frozen=True)
class StepListing:
    """A step directory as listed (nothing read): its commit record, if any, and files."""

    run: str
    step: int
    manifest: ObjectInfo | None  # None: uncommitted (a save in flight, or one that died)
    files: tuple[ObjectInfo, ...]

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def problem_from(run: str, step: int | None, error: BaseException) -> Problem:
    """Classify a read failure. Only ``corrupt`` and ``too_big`` (``errors.is_damage``) are
    proof of damage; the others say the checkpoint could not be looked at (and might be fine)."""
    if isinstance(error, RecordTooLargeError):
        kind = "too_big"
    elif is_damage(error):
        kind = "corrupt"
    elif isinstance(error, NewerFormatError):
        kind = "newer"
    elif isinstance(error, ColdObjectError):
        kind = "cold"
    elif isinstance(error, InvalidNameError):
        kind = "bad_name"
    elif isinstance(error, SymlinkError):
        kind = "symlink"
    elif isinstance(error, StoreError):
        kind = "unavailable"
    elif isinstance(error, PermissionError):
        kind = "denied"
    elif isinstance(error, OSError) and error.errno == errno.ELOOP:
        kind = "loop"
    else:
        kind = "unreadable"
    message = str(error) if isinstance(error, CkptflowError) else f"{type(error).__name__}: {error}"
    return Problem(run, step, kind, message)


def run_names(store: Store) -> list[str]:
    """Every directory under ``runs/``, valid run name or not (``listing`` reports the others)."""
    return [
        i.key.rstrip("/").rsplit("/", 1)[-1]
        for i in store.list(fmt.runs_prefix(), recursive=False)
        if i.key.endswith("/")
    ]


def list_runs(store: Store) -> list[str]:
    """The valid run names in the store."""
    out = []
    for name in run_names(store):
        try:
            out.append(fmt.validate_run(name))
        except InvalidNameError:
            continue
    return out


def _run_listing(
    store: Store, run: str, *, from_step: int | None, manifests_only: bool
) -> Iterator[StepListing | Problem]:
    prefix = fmt.checkpoints_prefix(run)
    # every key of ``from_step`` sorts after its bare directory name
    start = "" if from_step is None else f"{prefix}{fmt.validate_step(from_step):0{fmt.STEP_DIGITS}d}"
    try:
        if from_step is None and not manifests_only:
            listed = list(store.list(prefix))
        else:
            listed = list(store.list_after(prefix, start, roll_up=RANKS_ROLLED if manifests_only else ""))
    except (SymlinkError, PermissionError):  # somewhere below: find which step, so only that step is a problem
        yield from _steps_one_by_one(store, run, from_step=from_step, manifests_only=manifests_only)
        return
    if not listed and from_step is None and store.exists(prefix.rstrip("/")):
        yield Problem(
            run,
            None,
            "not_a_directory",
            f"{store.url}/{prefix.rstrip('/')} is a file where the run's checkpoints directory belongs; move it away",
        )
        return
    yield from _grouped(store, run, listed)


def _steps_one_by_one(
    store: Store, run: str, *, from_step: int | None, manifests_only: bool
) -> Iterator[StepListing | Problem]:
    for entry in store.list(fmt.checkpoints_prefix(run), recursive=False):
        step = fmt.parse_step_dir(entry.key)
        if step is None or (from_step is not None and step < from_step):
            continue
        roll_up = RANKS_ROLLED if manifests_only else ""
        try:
            listed = list(store.list_after(entry.key, "", roll_up=roll_up)) if entry.key.endswith("/") else [entry]
            yield from _grouped(store, run, listed)
        except (SymlinkError, PermissionError) as e:
            yield problem_from(run, step, e)


def _grouped(store: Store, run: str, listed: list[ObjectInfo]) -> Iterator[StepListing | Problem]:
    """Step listings (ascending) from the objects under a run's checkpoints."""
    prefix = fmt.checkpoints_prefix(run)
    by_step: dict[int, list[ObjectInfo]] = {}
    for info in listed:
        name, _, rest = info.key[len(prefix) :].partition("/")
        step = fmt.parse_step_dir(name)
        if step is None:
            continue
        if not rest:
            yield Problem(
                run,
                step,
                "not_a_directory",
                f"{store.url}/{info.key} is a file where a step directory belongs; move it away",
            )
            continue
        by_step.setdefault(step, []).append(info)
    for step in sorted(by_step):
        files = by_step[step]
        key = fmt.manifest_key(run, step)
        manifest = next((f for f in files if f.key == key), None)
        yield StepListing(run, step, manifest, tuple(files))


def listing(
    store: Store, run: str | None = None, *, from_steps: dict[str, int] | None = None, manifests_only: bool = False
) -> Iterator[StepListing | Problem]:
    """Every step directory of ``run`` (or of every run), ascending, without reading a
    record; a run directory that cannot be listed or is badly named is a ``Problem``.
    A run named in ``from_steps`` is listed from that step on (one listing of what
    follows it, where the store can start a listing there). ``manifests_only`` is for
    readers of the commit records alone: each step's rank records are one entry of its
    ``files`` (``<step>/ranks/``), so the listing does not grow with the ranks."""
    for name in [run] if run is not None else run_names(store):
        try:
            fmt.validate_run(name)
        except InvalidNameError as e:
            yield Problem(
                name,
                None,
                "bad_name",
                f"{store.url}/runs/{name}: {e}; ckptflow never writes such a directory: move it out of the store",
            )
            continue
        try:
            yield from _run_listing(store, name, from_step=(from_steps or {}).get(name), manifests_only=manifests_only)
        except (CkptflowError, OSError) as e:
            yield problem_from(name, None, e)


def no_such_step(run: str, step: int, steps: list[int]) -> str:
    """The one message for a step a run does not have, whoever was given it (restore, the
    command line): it names the steps there, the ones to give instead."""
    return f"run {run!r} has no step {step} (steps: {steps_text(steps)})"


def steps_text(steps: list[int]) -> str:
    """``steps`` (ascending) for a message: all of them up to 8, else the first, last and count."""
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} … {steps[-1]} ({len(steps)} in all)"


def committed_steps(store: Store, run: str) -> list[int]:
    """Steps of ``run`` that have a commit record (valid or not), ascending; no reads."""
    return [s.step for s in listing(store, run) if isinstance(s, StepListing) and s.committed]


def step_dirs(store: Store, run: str) -> list[int]:
    """Steps of ``run`` that have a directory (committed or not), ascending: one listing
    of directory names, so its cost does not grow with the files (ranks) of each step."""
    prefix = fmt.checkpoints_prefix(run)
    steps = [
        fmt.parse_step_dir(i.key[len(prefix) : -1]) for i in store.list(prefix, recursive=False) if i.key.endswith("/")
    ]
    return sorted(s for s in steps if s is not None)
