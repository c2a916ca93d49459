"""The ``ckptflow`` command: inspect, verify, export and garbage-collect a store from a shell.

Each command is a thin wrapper over a library function (catalog, export, stats, gc),
so scripts, the Dagster layer and humans get the same answers. Exit codes are part of
the interface: 0 success, 1 "verify found problems" or "gc could not safely sweep",
2 an error the user can act on
(bad arguments, unknown run, unreadable checkpoint), always as one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ckptflow.cli.commands import (
    cmd_export,
    cmd_gc,
    cmd_ls,
    cmd_stats,
    cmd_thaw,
    cmd_verify,
    duration_arg,
)
from ckptflow.cli.costs import add_arguments as cost_arguments
from ckptflow.cli.output import PROG, human_bytes
from ckptflow.errors import CkptflowError
from ckptflow.export import DTYPES

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

    p = sub.add_parser("stats", help="storage per run: logical, unique and stored bytes; cost per tier")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--json", action="store_true")
    cost_arguments(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("gc", help="delete chunks no checkpoint references")
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument(
        "--grace",
        required=True,
        type=duration_arg,
        help="only delete objects older than this (e.g. 1h); must exceed the slowest save",
    )
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--wait",
        type=duration_arg,
        default=60.0,
        help="how long to wait for saves that are writing chunks (default 60s); exit 1 if they do not finish",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="list every key")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("thaw", help="request S3 restores of a checkpoint in a cold storage class")
    p.add_argument("root", metavar="ROOT", help="s3://bucket/prefix")
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, help="default: the latest committed step")
    p.add_argument("--days", type=int, default=1, help="how long restored copies stay readable (default 1)")
    p.add_argument(
        "--tier",
        choices=["Expedited", "Standard", "Bulk"],
        default="Standard",
        help="retrieval speed and price (default Standard)",
    )
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
