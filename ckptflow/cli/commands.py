"""The CLI's commands over the catalog (``ls``, ``verify``, ``gc``, ``thaw``), and what
every command shares: opening a store without creating it, naming a run or step that
exists, the exit status of "the store could not be read".

Each is a thin wrapper over one library function. The commands that move checkpoints in
and out are in ``ckptflow.cli.export_import``; those that report figures, in
``ckptflow.cli.report_commands``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.catalog import selection
from ckptflow.catalog.checkpoints import CheckpointInfo
from ckptflow.catalog.gc import gc, parse_duration
from ckptflow.catalog.tiers import thaw
from ckptflow.cli.output import PROG, json_text, progress, table, warn
from ckptflow.errors import CkptflowError, StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.lifecycle.repair import repair
from ckptflow.reports.units import human_bytes, rounded
from ckptflow.store import Store, open_store


def open_existing(root: str) -> Store:
    """Open a store without creating it: for a command that only inspects, a typo in a
    local path must be an error, not a new empty store."""
    try:
        return open_store(root, create=False)
    except ValueError as e:
        raise CkptflowError(str(e)) from None


def root_arg(text: str) -> str:
    """A store root from the command line: an empty one would be the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("ROOT is empty: give a store path, a file:// or an s3://bucket/prefix URL")
    return text


def step_arg(text: str) -> int:
    """A step number from the command line: ASCII digits only (``int`` takes "1_0" as 10)."""
    if not re.fullmatch(r"[0-9]+", text):
        raise argparse.ArgumentTypeError(f"step {text!r} is not a step number (0, 1, 2, ...)")
    try:
        return fmt.validate_step(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def require_run(store: Store, run: str) -> str:
    """``run``, checked to be a run of ``store``; not knowing which runs exist is
    ``StoreUnavailableError``, not "no such run"."""
    fmt.validate_run(run)
    try:
        runs = catalog_listing.list_runs(store)
    except (CkptflowError, OSError) as e:  # not knowing which runs exist is no "no such run"
        raise StoreUnavailableError(f"could not list the runs in {store.url}: {e}") from e
    if run not in runs:
        raise CkptflowError(
            f"no run {run!r} in {store.url} (runs there: {', '.join(runs) or 'none'}); "
            f"`{PROG} ls ROOT` lists runs and checkpoints"
        )
    return run


def duration_arg(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative: a duration is 0 or more")
    return seconds


def _selected(
    store: Store, run: str | None, infos: list[CheckpointInfo], text: str
) -> tuple[list[CheckpointInfo], bool]:
    """The checkpoints a selector accepts, in its order, and whether it stopped at a record
    it could not read (nothing past it is known); why the others are not, on stderr."""
    if run is None:
        raise CkptflowError("--select chooses among one run's checkpoints: give --run too")
    try:
        select = selection.parse(text)
    except ValueError as e:
        raise CkptflowError(f"--select: {e}") from None
    by_step = {i.step: i for i in infos}
    if isinstance(select, int) and select not in by_step:  # a step, not a choice: "no checkpoints" hid the typo
        raise no_such_step(run, select, sorted(by_step))
    choice = selection.choose([store], run, select, [(s, 0) for s in sorted(by_step, reverse=True)])
    for step, why in choice.passed_over:
        warn(f"step {step}: {why}" if step >= 0 else why)
    if choice.stop is not None:
        warn(f"and no older one is listed: {choice.stop}")
    return [by_step[s] for s, _ in choice.pairs if s in by_step], choice.stop is not None


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_existing(args.root)
    run = require_run(store, args.run) if args.run else None
    infos: list[CheckpointInfo] = []
    for item in catalog.summaries(store, run):
        if isinstance(item, CheckpointInfo):
            infos.append(item)
        else:
            warn(str(item))
    stopped = False  # the selector stopped at a record it could not read: exit 3, as verify does
    if args.select is not None:
        infos, stopped = _selected(store, run, infos, args.select)
    status = UNAVAILABLE if stopped else 0
    if args.json:
        docs = [{**asdict(i), "created": datetime.fromtimestamp(i.created_at, timezone.utc).isoformat()} for i in infos]
        print(json_text(docs))
        return status
    if not infos:
        if not stopped:
            print(f"no checkpoints in {store.url}" + (f" for run {args.run}" if args.run else ""))
        return status
    rows = []
    for i in infos:
        meta = json.dumps(rounded(i.metadata), sort_keys=True, separators=(",", ":")) if i.metadata else ""
        rows.append(
            [
                i.run,
                str(i.step),
                i.kind,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created_at)),
                human_bytes(i.logical_bytes),
                human_bytes(i.stored_bytes),
                human_bytes(i.added_bytes),
                str(i.world_size),
                meta if len(meta) <= 60 else meta[:59] + "…",
            ]
        )
    headers = ["RUN", "STEP", "KIND", "CREATED", "LOGICAL", "STORED", "WRITTEN", "WORLD", "METADATA"]
    print(table(headers, rows, right={1, 4, 5, 6, 7}))
    return status


CORRUPT = 1  # verify's exit status when it found proof of damage (or debris: uncommitted steps, bad names)
UNAVAILABLE = 3  # ... when all it found was what could not be read: no verdict, retry (export too)


def cmd_verify(args: argparse.Namespace) -> int:
    store = open_existing(args.root)
    try:
        run = require_run(store, args.run)
    except StoreUnavailableError as e:
        return _could_not_read(store, str(e))
    listed = list(catalog_listing.listing(store, run))
    unlisted = [e for e in listed if isinstance(e, catalog_listing.Problem) and e.step is None and e.could_not_read]
    if unlisted:  # which steps exist is unknown: no "no step N", no "no committed checkpoints"
        return _could_not_read(store, f"could not list the checkpoints of run {run}: {unlisted[0].message}")
    steps = [e.step for e in listed if isinstance(e, catalog_listing.StepListing)]
    committed = [e.step for e in listed if isinstance(e, catalog_listing.StepListing) and e.committed]
    problems: list[str] = []
    proof = False  # a problem that is more than "could not be read"
    if args.all:
        targets = committed
        for entry in listed:
            if isinstance(entry, catalog_listing.Problem):
                problems.append(str(entry))
                proof = proof or not entry.could_not_read
            elif not entry.committed and entry.files:
                proof = True
                problems.append(
                    f"run {run} step {entry.step}: uncommitted: no manifest (a save crashed or is still "
                    f"running; `{PROG} gc` removes its files after the grace period)"
                )
    elif args.step is not None:
        if fmt.validate_step(args.step) not in steps:
            raise no_such_step(run, args.step, steps)
        targets = [args.step]
    else:
        if not committed:
            raise CkptflowError(f"run {run!r} has no committed checkpoints to verify")
        targets = committed[-1:]
    total = _verify_total(store, run, targets) if sys.stderr.isatty() else None
    with (
        progress(f"verify {run}", total) as report_progress,
        ThreadPoolExecutor(8, thread_name_prefix="ckptflow-verify") as pool,
    ):
        reports = [
            catalog.verify_checkpoint(store, run, step, pool, report_progress, deep=args.deep) for step in targets
        ]
    for report in reports:
        problems.extend(f"run {run} step {report.step}: {p}" for p in report.problems)
    if problems:
        for line in problems:
            print(line)
        if not proof and not any(r.damaged for r in reports):
            newer = any(r.newer for r in reports) or any(
                isinstance(e, catalog_listing.Problem) and e.kind == "newer" for e in listed if args.all
            )
            why = (
                "a newer ckptflow wrote what could not be read; verify it with a ckptflow that reads it"
                if newer
                else f"the store {store.url} could not be read (unavailable, cold, denied or a link); retry when it "
                "answers, thaw or fix access"
            )
            print(f"{PROG}: {len(problems)} problem(s), none of them proof of damage: {why}", file=sys.stderr)
            return UNAVAILABLE
        bad = sum(not r.ok for r in reports) + sum(isinstance(e, catalog_listing.Problem) for e in listed if args.all)
        print(
            f"{PROG}: {len(problems)} problem(s); {bad} of {len(reports)} checkpoint(s) of run {run} failed",
            file=sys.stderr,
        )
        return CORRUPT
    chunks = sum(r.chunks_checked for r in reports)
    nbytes = sum(r.bytes_checked for r in reports)
    what = f"step {targets[0]}" if len(targets) == 1 else f"{len(targets)} checkpoints"
    how = "chunk addresses (blake3, or sha256 before format 2)" if args.deep else "fast checksums"
    print(f"OK run {run}: {what} verified ({chunks} chunks, {human_bytes(nbytes)}, {how})")
    return 0


def _could_not_read(store: Store, why: str) -> int:
    print(
        f"{PROG}: the store {store.url} could not be read, so nothing was verified: {' '.join(why.splitlines())}; "
        "retry when it answers, thaw or fix access",
        file=sys.stderr,
    )
    return UNAVAILABLE


def no_such_step(run: str, step: int, steps: list[int]) -> CkptflowError:
    """A command given a step ``run`` does not have: the message restore gives too."""
    return CkptflowError(catalog_listing.no_such_step(run, step, steps))


def _verify_total(store: Store, run: str, steps: list[int]) -> int | None:
    total = 0
    for step in steps:
        try:
            total += sum(catalog.read_manifest(store, run, step).chunks.values())
        except (CkptflowError, OSError):
            pass  # verify reports it
    return total or None


UNSAFE_GRACE = 60.0  # seconds: below this, what a write without a save lease has under way looks like garbage


def cmd_gc(args: argparse.Namespace) -> int:
    if args.grace < UNSAFE_GRACE and not args.dry_run and not args.force:
        raise CkptflowError(
            f"--grace {args.grace:g}s would delete what writes without a save lease have under way (temp files, a "
            "copy made by hand, an older ckptflow's save still running: referenced only once its manifest commits); "
            "use a grace period longer than those take (e.g. --grace 1h), or pass --force if none can be running"
        )
    store = open_existing(args.root)
    with progress("gc") as report_progress:
        report = gc(store, args.grace, dry_run=args.dry_run, wait=args.wait, progress=report_progress)
    for problem in report.unreadable_manifests:
        warn(f"{problem}; GC keeps the chunks its JSON still names")
    for problem in report.ignored:
        warn(f"left alone: {problem}")
    for key in report.restored:
        warn(f"put back {key}: a conditional delete killed mid-way (an expiry racing a commit) had taken it aside")
    if report.skipped:
        print(
            f"{PROG}: {'a gc now would sweep' if args.dry_run else 'gc swept'} nothing: {report.skipped}",
            file=sys.stderr,
        )
        return 1
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {len(report.deleted)} object(s) ({human_bytes(report.bytes)}); "
        f"kept {report.kept_chunks} chunk(s); {report.live_manifests} live manifest(s)"
    )
    if args.verbose:
        for key, size in report.deleted:
            print(f"  {key}  {human_bytes(size)}")
    if report.live_leases:  # a dry run: a gc now would wait for these saves, then sweep nothing
        print(
            f"{PROG}: a gc now would sweep nothing: {len(report.live_leases)} save(s) are writing chunks "
            f"({report.live_leases[0]}); the above is what it deletes once they finish",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_thaw(args: argparse.Namespace) -> int:
    """Request S3 restores for a cold (Glacier / Deep Archive) checkpoint."""
    store = open_existing(args.root)
    run = require_run(store, args.run)
    committed = catalog_listing.committed_steps(store, run)
    step: int | None = args.step if args.step is not None else (committed[-1] if committed else None)
    if step not in committed:
        what = "committed checkpoint" if step is None else f"committed step {step}"
        raise CkptflowError(
            f"run {run!r} has no {what} to thaw (committed steps: {catalog_listing.steps_text(committed)})"
        )
    report = thaw(store, run, step, days=args.days, tier=args.tier)
    print(
        f"run {run} step {step}: restore requested for {report.requested} cold object(s) of {report.objects} "
        f"({args.tier}, readable for {args.days} day(s) once restored)"
    )
    if report.manifest_cold:
        print(
            f"the manifest is still cold, so its chunks are not known yet: run `{PROG} thaw` again "
            "once its restore has finished"
        )
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    """Replace the chunk objects ROOT records as damaged with sound copies from other tiers
    (``ckptflow.lifecycle.repair``): exit 1 if one has no sound copy anywhere, 3 if a tier,
    or a checkpoint of ROOT that may list one, could not be read (retry, or upgrade)."""
    store = open_existing(args.root)
    sources = [open_existing(url) for url in args.sources]
    with progress(f"repair {store.url}") as report_progress:
        report = repair(store, sources, progress=report_progress)
    for digest, url in report.repaired:
        print(f"repaired chunk {digest[:16]}… from {url}")
    for digest, why in report.unrepaired:
        print(f"not repaired: chunk {digest[:16]}… has no sound copy in the tiers given: {why}")
    for digest, why in report.unavailable:
        print(f"not repaired yet: chunk {digest[:16]}…: a tier could not be read, retry: {why}")
    for problem in report.unlisted:
        warn(f"a checkpoint could not be read, so its chunks were not looked up: {problem}")
    if report.unreferenced:
        print(f"{report.unreferenced} damage record(s) of chunks no checkpoint lists: `{PROG} gc` removes them")
    if report.unresolved:
        print(
            f"not repaired yet: {len(report.unresolved)} damage record(s) of chunks no checkpoint read lists; "
            "the unread checkpoint(s) above may list them: once they read (retry, or upgrade ckptflow), repair again"
        )
    if not (report.repaired or report.unrepaired or report.unavailable or report.unreferenced or report.unresolved):
        print(f"no damaged chunk objects recorded in {store.url}")
    if report.unrepaired:
        return 1
    return UNAVAILABLE if report.unavailable or report.unresolved else 0
