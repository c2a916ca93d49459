"""The ``ckptflow`` command: inspect, verify, export and garbage-collect a store from a shell.

Each command is a thin wrapper over a library function (catalog, export, stats, gc),
so scripts, the Dagster layer and humans get the same answers. Exit codes are part of
the interface: 0 success, 1 "verify found problems" or "gc could not safely sweep",
2 an error the user can act on
(bad arguments, unknown run, unreadable checkpoint), always as one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone

from ckptflow import catalog, recoveries
from ckptflow import format as fmt
from ckptflow.catalog import CheckpointInfo
from ckptflow.errors import CkptflowError
from ckptflow.export import DTYPES, export_safetensors
from ckptflow.gc import gc, parse_duration
from ckptflow.manifest import Manifest
from ckptflow.stats import store_stats
from ckptflow.store import Store, open_store
from ckptflow.tiers import thaw

PROG = "ckptflow"


class UsageError(CkptflowError):
    """A command line argparse rejected; reported like every other expected error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and sys.exit(2)
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ---- helpers ---------------------------------------------------------------------------
def human_bytes(n: int | float) -> str:
    """Binary units, one decimal: what `ls -h` users expect."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _table(headers: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _open(root: str) -> Store:
    """Open a store without creating it: for a command that only inspects, a typo in a
    local path must be an error, not a new empty store."""
    try:
        return open_store(root, create=False)
    except ValueError as e:
        raise CkptflowError(str(e)) from None


def _require_run(store: Store, run: str) -> str:
    fmt.validate_run(run)
    runs = catalog.list_runs(store)
    if run not in runs:
        raise CkptflowError(
            f"no run {run!r} in {store.url} (runs there: {', '.join(runs) or 'none'}); "
            f"`{PROG} ls ROOT` lists runs and checkpoints"
        )
    return run


@contextlib.contextmanager
def _progress(desc: str, total: int | None = None) -> Iterator[Callable[[int], None] | None]:
    """A byte-counting tqdm bar on an interactive stderr; ``None`` (silence) otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    lock = threading.Lock()  # the callbacks come from reader/verify thread pools
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        def update(n: int) -> None:
            with lock:
                bar.update(n)

        yield update


def _duration(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"grace {text!r} is negative; it must be at least the slowest save")
    return seconds


# ---- commands --------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    store = _open(args.root)
    run = _require_run(store, args.run) if args.run else None
    infos: list[CheckpointInfo] = []
    for item in catalog.committed(store, run):
        if isinstance(item, Manifest):
            infos.append(CheckpointInfo.from_manifest(item))
        else:
            _warn(str(item))
    if args.json:
        docs = [
            {**asdict(i), "created": datetime.fromtimestamp(i.created_at, timezone.utc).isoformat()}
            for i in infos
        ]
        print(json.dumps(docs, indent=2, sort_keys=True))
        return 0
    if not infos:
        print(f"no checkpoints in {store.url}" + (f" for run {args.run}" if args.run else ""))
        return 0
    rows = []
    for i in infos:
        meta = json.dumps(i.metadata, sort_keys=True, separators=(",", ":")) if i.metadata else ""
        rows.append([
            i.run, str(i.step), i.kind, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created_at)),
            human_bytes(i.logical_bytes), human_bytes(i.stored_bytes), human_bytes(i.bytes_written),
            str(i.world_size), meta if len(meta) <= 60 else meta[:59] + "…",
        ])
    headers = ["RUN", "STEP", "KIND", "CREATED", "LOGICAL", "STORED", "WRITTEN", "WORLD", "METADATA"]
    print(_table(headers, rows, right={1, 4, 5, 6, 7}))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open(args.root)
    run = _require_run(store, args.run)
    listed = list(catalog.listing(store, run))
    steps = [e.step for e in listed if isinstance(e, catalog.StepListing)]
    committed = [e.step for e in listed if isinstance(e, catalog.StepListing) and e.committed]
    problems: list[str] = []
    if args.all:
        targets = committed
        for entry in listed:
            if isinstance(entry, catalog.Problem):
                problems.append(str(entry))
            elif not entry.committed and entry.files:
                problems.append(
                    f"run {run} step {entry.step}: uncommitted: no manifest (a save crashed or is still "
                    f"running; `{PROG} gc` removes its files after the grace period)"
                )
    elif args.step is not None:
        if fmt.validate_step(args.step) not in steps:
            raise CkptflowError(f"run {run!r} has no step {args.step} (steps: {_short(steps)})")
        targets = [args.step]
    else:
        if not committed:
            raise CkptflowError(f"run {run!r} has no committed checkpoints to verify")
        targets = committed[-1:]
    total = _verify_total(store, run, targets) if sys.stderr.isatty() else None
    with _progress(f"verify {run}", total) as progress, ThreadPoolExecutor(8, thread_name_prefix="ckptflow-verify") as pool:
        reports = [catalog.verify_checkpoint(store, run, step, pool, progress) for step in targets]
    for report in reports:
        problems.extend(f"run {run} step {report.step}: {p}" for p in report.problems)
    if problems:
        for line in problems:
            print(line)
        bad = sum(not r.ok for r in reports) + sum(isinstance(e, catalog.Problem) for e in listed if args.all)
        print(f"{PROG}: {len(problems)} problem(s); {bad} of {len(reports)} checkpoint(s) of run {run} failed", file=sys.stderr)
        return 1
    chunks = sum(r.chunks_checked for r in reports)
    nbytes = sum(r.bytes_checked for r in reports)
    what = f"step {targets[0]}" if len(targets) == 1 else f"{len(targets)} checkpoints"
    print(f"OK run {run}: {what} verified ({chunks} chunks, {human_bytes(nbytes)})")
    return 0


def _short(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} … {steps[-1]} ({len(steps)} in all)"


def _verify_total(store: Store, run: str, steps: list[int]) -> int | None:
    total = 0
    for step in steps:
        try:
            total += sum(catalog.read_manifest(store, run, step).chunks.values())
        except (CkptflowError, OSError):
            pass  # verify reports it
    return total or None


def cmd_export(args: argparse.Namespace) -> int:
    store = _open(args.root)
    run = _require_run(store, args.run)
    with _progress(f"export {run}") as progress:
        result = export_safetensors(
            store, run, args.out, step=args.step, key=args.key, dtype=args.dtype, progress=progress
        )
    for step, why in result.skipped:
        _warn(f"run {run} step {step} does not verify, skipped: {why}")
    print(
        f"exported run {run} step {result.step} ({args.key}): {result.tensors} tensors, "
        f"{human_bytes(result.bytes)} -> {result.path}"
    )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    store = _open(args.root)
    stats = store_stats(store)
    operations = recoveries.store_metrics(store)
    for problem in stats.unreadable_manifests:
        _warn(f"not counted: {problem}")
    if args.json:
        print(json.dumps({**stats.as_dict(), "operations": [m.as_dict() for m in operations]}, indent=2, sort_keys=True))
        return 0
    headers = ["RUN", "CHECKPOINTS", "LOGICAL", "UNIQUE", "STORED", "DEDUP", "COMPRESSION"]
    rows = [
        [r.run, str(r.checkpoints), human_bytes(r.logical_bytes), human_bytes(r.unique_bytes),
         human_bytes(r.stored_bytes), _ratio(r.dedup_ratio), _ratio(r.compression_ratio)]
        for r in stats.runs
    ]
    rows.append(["(store)", str(stats.checkpoints), human_bytes(stats.logical_bytes), human_bytes(stats.unique_bytes),
                 human_bytes(stats.stored_bytes), _ratio(stats.dedup_ratio), _ratio(stats.compression_ratio)])
    print(_table(headers, rows, right={1, 2, 3, 4, 5, 6}))
    print(
        f"chunk files: {stats.chunk_files} ({human_bytes(stats.chunk_file_bytes)}); unreferenced: "
        f"{stats.unreferenced_chunks} ({human_bytes(stats.unreferenced_bytes)})"
        + (f", reclaimable with `{PROG} gc` once older than the grace period" if stats.unreferenced_chunks else "")
    )
    for r in stats.runs:
        if r.missing_chunks:
            _warn(f"run {r.run} references {r.missing_chunks} chunk(s) missing from the store; run `{PROG} verify`")
    print()
    headers = ["RUN", "SAVE EVERY", "READY AFTER", "RECOVERIES", "SUCCEEDED", "FELL BACK", "RESTORE"]
    print(_table(headers, [
        [m.run, _secs(m.save_interval_s), _secs(m.ready_s), str(m.recoveries), str(m.recoveries_ok),
         str(m.fallbacks), _secs(m.restore_s)] for m in operations
    ], right={1, 2, 3, 4, 5, 6}))
    return 0


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open(args.root)
    with _progress("gc") as progress:
        report = gc(store, args.grace, dry_run=args.dry_run, wait=args.wait, progress=progress)
    for problem in report.unreadable_manifests:
        _warn(f"{problem}; GC keeps the chunks its JSON still names")
    for problem in report.ignored:
        _warn(f"left alone: {problem}")
    if report.skipped:
        print(f"{PROG}: gc swept nothing: {report.skipped}", file=sys.stderr)
        return 1
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {len(report.deleted)} object(s) ({human_bytes(report.bytes)}); "
        f"kept {report.kept_chunks} chunk(s); {report.live_manifests} live manifest(s)"
    )
    if args.verbose:
        for key, size in report.deleted:
            print(f"  {key}  {human_bytes(size)}")
    return 0


def cmd_thaw(args: argparse.Namespace) -> int:
    """Request S3 restores for a cold (Glacier / Deep Archive) checkpoint."""
    store = _open(args.root)
    run = _require_run(store, args.run)
    committed = catalog.committed_steps(store, run)
    step = args.step if args.step is not None else (committed or [None])[-1]
    if step not in committed:
        what = "committed checkpoint" if step is None else f"committed step {step}"
        raise CkptflowError(f"run {run!r} has no {what} to thaw (committed steps: {_short(committed)})")
    report = thaw(store, run, step, days=args.days, tier=args.tier)
    print(f"run {run} step {step}: restore requested for {report.requested} cold object(s) of {report.objects} "
          f"({args.tier}, readable for {args.days} day(s) once restored)")
    if report.manifest_cold:
        print(f"the manifest is still cold, so its chunks are not known yet: run `{PROG} thaw` again "
              "once its restore has finished")
    return 0


# ---- parser ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect and manage a ckptflow checkpoint store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    root_help = "store root: a path, file:// or s3://bucket/prefix URL"

    p = sub.add_parser("ls", help="list runs and checkpoints")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--run", help="only this run")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="re-read and check checkpoints (exit 1 if any is corrupt)")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--run", required=True)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="this step (default: the latest committed one)")
    which.add_argument("--all", action="store_true", help="every step, also reporting uncommitted ones")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, help="default: the newest checkpoint that verifies")
    p.add_argument("--out", required=True, help="output .safetensors path (replaced atomically)")
    p.add_argument("--key", default="model", help="state entry to export (default: model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="convert floating-point tensors")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("stats", help="storage per run: logical, unique and stored bytes")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("gc", help="delete chunks no checkpoint references")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--grace", required=True, type=_duration,
                   help="only delete objects older than this (e.g. 1h); must exceed the slowest save")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--wait", type=_duration, default=60.0,
                   help="how long to wait for saves that are writing chunks (default 60s); exit 1 if they do not finish")
    p.add_argument("-v", "--verbose", action="store_true", help="list every key")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("thaw", help="request S3 restores of a checkpoint in a cold storage class")
    p.add_argument("root", metavar="ROOT", help="s3://bucket/prefix")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, help="default: the latest committed step")
    p.add_argument("--days", type=int, default=1, help="how long restored copies stay readable (default 1)")
    p.add_argument("--tier", choices=["Expedited", "Standard", "Bulk"], default="Standard",
                   help="retrieval speed and price (default Standard)")
    p.set_defaults(func=cmd_thaw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status instead of exiting (testable, embeddable)."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except (CkptflowError, OSError) as e:
        if isinstance(e, BrokenPipeError):  # `ckptflow ls | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        message = " ".join(str(e).split("\n"))
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
