"""Lifecycle records: verdicts about one committed checkpoint, keyed by what was committed.

A record lives at ``lifecycle/<run>/<step:012d>/<manifest digest>/<what>.json`` in the
hot store, next to the data rather than only in an orchestrator's database, so the
inventory, retention, the CLI and a fresh Dagster instance read the same answers.

The key holds the manifest digest because a step can be committed twice (restore
rejects step 20, training falls back and saves step 20 again): the verdicts about the
first commit are history, and the new commit starts with none. Readers ask for the
records of the digest they are looking at (``read_record``) or of every checkpoint's
current digest (``records_by_subject``).

GC never sweeps ``lifecycle/``; expiring a checkpoint deletes its records.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ckptflow.catalog.object_index import ObjectIndex, record_value
from ckptflow.catalog.records import SMALL_RECORD_BYTES, is_number, read_object
from ckptflow.errors import (
    CkptflowError,
    FailedValidationError,
    InvalidNameError,
    ManifestError,
    ObjectNotFoundError,
    RecordTooLargeError,
    is_damage,
)
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store.base import ObjectInfo, Store

PREFIX = "lifecycle/"
# "trainer": what a trainer reported about its commit after committing it (the Lightning plugin's
# later saves at a step: ``ckptflow.integrations.lightning_overlay``)
KINDS = ("validation", "evaluation", "compression", "archive", "failure", "trainer")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subject:
    """The checkpoint a record is about: ``(run, step)`` and the digest of its manifest."""

    run: str
    step: int
    digest: str

    @classmethod
    def of(cls, manifest: Manifest) -> Subject:
        return cls(manifest.run, manifest.step, manifest.digest)

    @property
    def ref(self) -> tuple[str, int]:
        return (self.run, self.step)


def step_prefix(run: str, step: int) -> str:
    return f"{PREFIX}{fmt.validate_run(run)}/{fmt.validate_step(step):0{fmt.STEP_DIGITS}d}/"


def record_key(subject: Subject, what: str) -> str:
    if what not in KINDS:
        raise ValueError(f"lifecycle record {what!r} is not one of {KINDS}")
    if not fmt.is_digest(subject.digest):
        raise InvalidNameError(f"lifecycle records are keyed by a manifest's sha256 digest, got {subject.digest!r}")
    return f"{step_prefix(subject.run, subject.step)}{subject.digest}/{what}.json"


def write_record(store: Store, subject: Subject, what: str, data: dict[str, Any]) -> dict[str, Any]:
    """Replace the ``what`` record of ``subject`` (stamped with ``recorded_at``)."""
    body = {**data, "manifest_digest": subject.digest, "recorded_at": data.get("recorded_at", time.time())}
    store.replace(record_key(subject, what), json.dumps(body, sort_keys=True, allow_nan=True).encode())
    return body


def read_record(store: Store, subject: Subject, what: str) -> dict[str, Any] | None:
    """The ``what`` record of ``subject``; None when there is none, or it is damaged (said
    in the log, naming the object): a damaged verdict is no verdict."""
    key = record_key(subject, what)
    try:
        record: Any = read_object(store, key)
    except ObjectNotFoundError:
        return None
    except (ManifestError, RecordTooLargeError) as e:
        record = e
    return _sound(record, what, f"{store.url}/{key}")


def _sound(record: Any, what: str, where: str) -> dict[str, Any] | None:
    """``record`` if it has the shape ckptflow writes a ``what`` record in, else None, with a
    warning. The fields checked are those decisions read: a validation or archive record's
    ``ok`` (``"false"``, a string, is truthy: a failed verdict read as passed), an
    evaluation's or a trainer's ``metrics`` (ranked by ``Best``, retention and promotion;
    ckptflow records finite numbers only), and when it was recorded."""
    problem = _shape_problem(record, what)
    if problem is None:
        return record
    log.warning(
        "lifecycle record %s is damaged (%s) and counts as none; delete it (the next %s of that checkpoint "
        "records it anew)",
        where,
        problem,
        what,
    )
    return None


def _shape_problem(record: Any, what: str) -> str | None:
    if isinstance(record, CkptflowError):
        return str(record)
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if "recorded_at" in record and not is_number(record["recorded_at"]):
        return f"'recorded_at' is {record['recorded_at']!r}, not a time"
    if what in ("validation", "archive") and type(record.get("ok")) is not bool:
        return f"'ok' is {record.get('ok')!r}, not true or false"
    metrics = record.get("metrics")
    if what in ("evaluation", "trainer") and not (
        isinstance(metrics, dict) and all(isinstance(k, str) and is_number(v) for k, v in metrics.items())
    ):
        return "'metrics' is not an object of finite numbers"
    return None


@dataclass(frozen=True)
class Unread:
    """A record that could not be read (an outage, a denied read): it proves nothing, and
    a decision resting on it must not read its absence as "none"."""

    step: int
    digest: str
    kind: str
    why: str  # the record's URL and the error


def records_by_subject(
    store: Store, run: str | None = None, *, unread: list[Unread] | None = None
) -> dict[tuple[str, int, str], dict[str, dict[str, Any]]]:
    """Every record under ``lifecycle/`` (or one run's) by ``(run, step, digest)``, then
    kind: one listing plus small reads (a ``trainer`` record without its ``changes``:
    ``_indexed``). A record that could not be read (an outage) is
    left out, as unknown, and added to ``unread``: a decision made on it (what a restore
    recovers to) must stop there rather than take its absence for "not validated"."""
    return _read(store, PREFIX if run is None else f"{PREFIX}{fmt.validate_run(run)}/", unread)


def _subject_of(key: str) -> tuple[str, int, str, str] | None:
    """``(run, step, digest, kind)`` a record's key names; None for any other key (records
    of the layout before digests, or debris: history nobody reads)."""
    parts = key[len(PREFIX) :].split("/")
    if len(parts) != 4 or not parts[3].endswith(".json") or parts[3][:-5] not in KINDS:
        return None
    step = fmt.parse_step_dir(parts[1])
    return None if step is None else (parts[0], step, parts[2], parts[3][:-5])


def _read(
    store: Store, prefix: str, unread: list[Unread] | None = None
) -> dict[tuple[str, int, str], dict[str, dict[str, Any]]]:
    """One listing; the records' contents through each run's listing-validated index, so
    a store with thousands of records costs one read per run once they are known."""
    by_run: dict[str, list[tuple[ObjectInfo, tuple[str, int, str, str]]]] = defaultdict(list)
    for info in store.list(prefix):
        subject = _subject_of(info.key)
        if subject is not None:
            by_run[subject[0]].append((info, subject))
    out: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for run, listed in by_run.items():
        try:
            name = f"lifecycle/{fmt.validate_run(run)}"
            index = ObjectIndex(store, name, _indexed, limit=SMALL_RECORD_BYTES, schema=INDEX_SCHEMA)
            values = index.values([info for info, _ in listed])
        except CkptflowError:
            continue  # a stray directory under lifecycle/: not a run's records
        for info, (_, step, digest, kind) in listed:
            value = values[info.key]
            if isinstance(value, Exception) and not is_damage(value):
                if unread is not None:
                    unread.append(Unread(step, digest, kind, f"{store.url}/{info.key} ({value})"))
                continue  # not read (an outage, access denied): that proves nothing about it
            record = _sound(value, kind, f"{store.url}/{info.key}")
            if record is not None:
                out[(run, step, digest)][kind] = record
    return dict(out)


INDEX_SCHEMA = 2  # 2: ``trainer`` records without their changes (an index of 1 kept them: rebuilt)


def _indexed(info: ObjectInfo, blob: bytes) -> Any:
    """A record as the run's index keeps it: a ``trainer`` record without its ``changes``
    (entries and callbacks' states, up to 1 MiB a step: the Lightning plugin reads them
    with ``read_record``), so the index of a long run stays the size of its metrics."""
    value = record_value(info, blob)
    if info.key.endswith("/trainer.json") and isinstance(value, dict):
        value.pop("changes", None)
    return value


def subjects_with(store: Store, what: str) -> set[tuple[str, int, str]]:
    """``(run, step, digest)`` of every commit that has a ``what`` record: one listing of
    key names, no reads."""
    subjects = (_subject_of(info.key) for info in store.list(PREFIX))
    return {(run, step, digest) for run, step, digest, kind in filter(None, subjects) if kind == what}


def step_record_keys(
    store: Store, run: str, step: int, *, keep: Collection[str] = (), only: str | None = None
) -> list[str]:
    """Keys of the records of a step, for ``expire`` to delete: every commit's but those
    ``keep`` names (another tier holds them: their verdicts still describe them), or
    ``only`` that commit's."""
    prefix = step_prefix(run, step)
    keys = []
    for info in store.list(prefix):
        digest = info.key[len(prefix) :].split("/", 1)[0]
        if digest not in keep and only in (None, digest):
            keys.append(info.key)
    return keys


def previous_record(
    store: Store, run: str, step: int, what: str, *, current: Callable[[int], str | None]
) -> tuple[int, dict[str, Any]] | None:
    """The ``what`` record of the current commit of the nearest older step of ``run``
    that has one: one listing of key names, then ``current`` (the digest of the commit
    an older step holds now; None: none) and one read per step looked at. A record of
    a commit the step no longer holds (committed again since) describes nothing there."""
    steps: dict[int, set[str]] = defaultdict(set)
    for info in store.list(f"{PREFIX}{fmt.validate_run(run)}/"):
        subject = _subject_of(info.key)
        if subject is not None and subject[3] == what and subject[1] < step:
            steps[subject[1]].add(subject[2])
    for older in sorted(steps, reverse=True):
        digest = current(older)
        if digest not in steps[older]:
            continue
        record = read_record(store, Subject(run, older, digest), what)
        if record is not None:
            return older, record
    return None


def check_not_failed(records: Store, manifest: Manifest, *, allow_failed: bool, how_to_allow: str) -> dict | None:
    """The failed validation verdict of exactly this commit (its manifest digest), or None.

    Without ``allow_failed`` a failed verdict raises ``FailedValidationError`` saying when it was
    recorded, what failed and how to go on (``how_to_allow``: the caller's opt-in). The
    verdict stands until validation runs again, even if the bytes verify now: a record
    is history, and only a new validation replaces it."""
    verdict = read_record(records, Subject.of(manifest), "validation")
    if verdict is None or verdict.get("ok"):
        return None
    if not allow_failed:
        when, problems = describe_verdict(verdict)
        raise FailedValidationError(
            f"run {manifest.run!r} step {manifest.step} failed validation (recorded {when} for manifest "
            f"{manifest.digest[:12]}…, in {verdict.get('tier') or records.url}): {problems}. "
            "Refused: part of this commit was proved damaged, so none of it is trusted. Choose another step, "
            f"validate this one again if it was repaired, or {how_to_allow}"
        )
    return verdict


def describe_verdict(verdict: dict) -> tuple[str, str]:
    """When a validation verdict was recorded and its first problems, as a refusal says them."""
    recorded, when = verdict.get("recorded_at"), "at an unknown time"
    if isinstance(recorded, (int, float)) and is_number(recorded):
        try:
            when = datetime.fromtimestamp(recorded, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        except (OverflowError, ValueError, OSError):  # a time no calendar holds: a verdict an import carried
            pass
    problems = [str(p) for p in verdict.get("problems") or []] or ["no problem recorded"]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return when, "; ".join(problems[:3]) + more


CARRIED_START, CARRIED_MIDDLE = "imported from ", ", exported despite a failed validation (recorded "


def carried_failure(metadata: Mapping[str, Any]) -> str | None:
    """The problem a commit imported with ``allow_failed`` carries (its metadata's
    ``import.failed_validation``: the verdict its source was exported despite), said as a
    validation problem; None for any other commit. Validation keeps it beside what it finds
    itself: the commit's bytes verify, and an ok verdict over the carried one would pass it
    for a validated model as soon as the lifecycle validated it."""
    imported = metadata.get("import")
    if not isinstance(imported, Mapping) or not isinstance(imported.get("failed_validation"), dict):
        return None
    failed = imported["failed_validation"]
    when, problems = describe_verdict(failed)
    source = imported.get("source") or "its source"
    return f"{CARRIED_START}{source}{CARRIED_MIDDLE}{when}): {problems}"


def is_carried(problem: str) -> bool:
    """Whether a validation problem is the verdict an import carries (``carried_failure``'s
    wording), not something found in the checkpoint's bytes: its text names the source's
    chunks, which this checkpoint need not have."""
    return problem.startswith(CARRIED_START) and CARRIED_MIDDLE in problem
