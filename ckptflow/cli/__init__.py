"""The ``ckptflow`` command: inspect, verify, import, export and garbage-collect a store from a shell.

Each command is a thin wrapper over a library function (catalog, export, stats, gc),
so scripts, the Dagster layer and humans get the same answers. Exit codes are part of
the interface: 0 success, 1 "verify found problems" or "gc swept nothing" (saves still
writing after ``--wait``, a commit record whose chunks cannot be told, or one a conditional
delete took aside less than a minute ago; a dry run too),
2 an error the user can act on
(bad arguments, unknown run, unreadable checkpoint, another gc holding the store's GC lock,
a link or an unreadable directory where gc must list), always as one line on stderr,
3 "verify or export could not read the store" (unavailable, cold, denied, a link: nothing
proved damage, so export does not fall back to an older step; retry, thaw or fix access).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ckptflow.cli.advise import add_arguments as advise_arguments
from ckptflow.cli.commands import (
    UNAVAILABLE,
    cmd_gc,
    cmd_ls,
    cmd_repair,
    cmd_thaw,
    cmd_verify,
    duration_arg,
    root_arg,
    step_arg,
)
from ckptflow.cli.costs import add_arguments as cost_arguments
from ckptflow.cli.export_import import cmd_export, cmd_import, size_arg
from ckptflow.cli.output import PROG, os_error_text
from ckptflow.cli.report_commands import cmd_advise, cmd_stats
from ckptflow.errors import CkptflowError, NewerFormatError, StoreUnavailableError
from ckptflow.format.layout import IMPORT_FORMATS
from ckptflow.interop.export import EXPORT_DTYPES
from ckptflow.reports.units import human_bytes

EXPORT_FORMATS = ("hf", "dcp")

__all__ = ["build_parser", "human_bytes", "main"]


class UsageError(CkptflowError):
    """A command line argparse rejected; reported like every other expected error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and sys.exit(2)
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect and manage a ckptflow checkpoint store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    root_help = "store root: a path, file:// or s3://bucket/prefix URL"

    p = sub.add_parser("ls", help="list runs and checkpoints")
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument("--run", help="only this run")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument(
        "--select",
        help="with --run: only the checkpoints restore(select=...) would consider, in the order it tries them: "
        "latest, validated, best:<metric>[:min|max], <model>@<alias> or a step (why others are not: on stderr)",
    )
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify", help="re-read and check checkpoints (exit 1 if any is corrupt, 3 if the store could not be read)"
    )
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument("--run", required=True)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, help="this step (default: the latest committed one)")
    which.add_argument("--all", action="store_true", help="every step, also reporting uncommitted ones")
    p.add_argument(
        "--deep",
        action="store_true",
        help="re-hash every chunk's address (BLAKE3, sha256 before format 2: what dedup and GC trust) instead "
        "of checking the fast checksums restore checks; slower, and also catches a chunk forged to pass the "
        "fast checksum",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "export",
        help="write a checkpoint as a model directory, one safetensors file, or a plain DCP checkpoint "
        "(exit 3 if the store could not be read)",
    )
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument("--run", required=True)
    p.add_argument(
        "--step",
        type=step_arg,
        help="default: the newest checkpoint that verifies, past damaged ones only (exit 3 if one could not be read)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="a new directory (model.safetensors or shards, config.json, README.md; from_pretrained loads it) "
        "or a new FILE.safetensors (written atomically; an existing one is refused, never replaced); with "
        "--format dcp a new DCP checkpoint directory",
    )
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf (default): the model's weights as a model directory or safetensors file; dcp: the whole state "
        "as a plain torch.distributed.checkpoint directory (dcp.load with FileSystemReader reads it)",
    )
    p.add_argument("--key", help="hf: state entry to export (default: model)")
    p.add_argument(
        "--dtype",
        choices=[d for d in EXPORT_DTYPES if d],
        help="convert floating-point tensors; int8: quantize nn.Linear weights (per-row scales, compressed-tensors)",
    )
    p.add_argument(
        "--allow-fp16-overflow",
        action="store_true",
        help="with --dtype fp16, write inf for values beyond fp16's range instead of refusing",
    )
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        help="shard a model directory's weights past this size (default 5GB, as transformers counts)",
    )
    p.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help="hf: the model's transformers config.json, for a checkpoint that recorded none: written (declaring "
        "the dtype and int8 quantization) as the directory's config.json; needed for --dtype int8",
    )
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="export a lossy archive copy (refused otherwise, as restore refuses it); every file says it is lossy",
    )
    p.add_argument(
        "--allow-failed",
        action="store_true",
        help="export a checkpoint whose validation verdict is failed (refused otherwise, saying when and why)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import", help="commit a DCP directory, safetensors file, HF model directory or .pt file as a checkpoint"
    )
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help + " (created if missing)")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=step_arg, required=True, help="the step to commit it as (must be free)")
    p.add_argument("src", metavar="SRC", help="what to import")
    p.add_argument(
        "--format",
        choices=["auto", *IMPORT_FORMATS],
        default="auto",
        help="default: from what SRC holds (a .metadata file: dcp; model.safetensors: hf; "
        "*.safetensors; *.pt, .pth, .bin, .ckpt: torch, read with weights_only=True)",
    )
    p.add_argument(
        "--allow-failed",
        action="store_true",
        help="import an export made despite a failed validation (refused otherwise); the new checkpoint keeps "
        "the verdict, failed (validating it again keeps it: validate the source again and export it anew)",
    )
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "stats",
        help="storage and its cost per run and tier; checkpoint frequency, recovery-readiness, recoveries, RPO, RTO",
    )
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument("--archive", metavar="URL", help="also count the archive tier at URL (priced in --archive-class)")
    p.add_argument("--window", type=duration_arg, default=86400.0, help="history for frequency and RPO (default 1d)")
    p.add_argument(
        "--detection",
        type=duration_arg,
        default=0.0,
        help="time your scheduler takes to notice a crash and restart the job; added to restore times for RTO",
    )
    p.add_argument("--json", action="store_true")
    cost_arguments(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("gc", help="delete chunks no checkpoint references")
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument(
        "--grace",
        required=True,
        type=duration_arg,
        help="only delete objects older than this (e.g. 1h); protects what is written without a save lease",
    )
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="allow a grace period under a minute (deletes what writes without a save lease have under way)",
    )
    p.add_argument(
        "--wait",
        type=duration_arg,
        default=60.0,
        help="how long to wait for saves in flight, planning to commit (default 60s); exit 1 if they do not finish",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="list every key")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "repair",
        help="replace chunk objects the store records as damaged with sound copies from other tiers "
        "(exit 1 if one has none, 3 if a tier, or a checkpoint that may list one, could not be read)",
    )
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    p.add_argument(
        "--from",
        dest="sources",
        metavar="URL",
        action="append",
        required=True,
        help="a tier holding the same checkpoints (the hot store for an archive, the archive for the hot "
        "store); repeat to try several in order",
    )
    p.set_defaults(func=cmd_repair)

    p = sub.add_parser("thaw", help="request S3 restores of a checkpoint in a cold storage class")
    p.add_argument("root", metavar="ROOT", type=root_arg, help="s3://bucket/prefix")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=step_arg, help="default: the latest committed step")
    p.add_argument("--days", type=int, default=1, help="how long restored copies stay readable (default 1)")
    p.add_argument(
        "--tier",
        choices=["Expedited", "Standard", "Bulk"],
        default="Standard",
        help="retrieval speed and price (default Standard)",
    )
    p.set_defaults(func=cmd_thaw)

    p = sub.add_parser("advise", help="how often a run should checkpoint (cost model), next to how often it does")
    p.add_argument("root", metavar="ROOT", type=root_arg, help=root_help)
    advise_arguments(p, duration_arg)
    p.set_defaults(func=cmd_advise)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status instead of exiting (testable, embeddable)."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except (CkptflowError, OSError) as e:
        if isinstance(e, BrokenPipeError):  # `ckptflow ls | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        text = (
            str(e)
            if isinstance(e, CkptflowError)
            else os_error_text(
                e,
                command=getattr(args, "command", None),
                store=getattr(args, "root", None),
                out=getattr(args, "out", None),
            )
        )
        message = " ".join(text.split("\n"))
        print(f"{PROG}: error: {message}", file=sys.stderr)
        unread = isinstance(e, (StoreUnavailableError, NewerFormatError))
        unread = unread and getattr(args, "func", None) in (cmd_verify, cmd_export)
        return UNAVAILABLE if unread else 2  # verify and export keep "3: no verdict: it could not be read"
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
