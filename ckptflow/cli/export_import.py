"""The CLI's commands that move checkpoints across a store's edge: ``export`` (a model
directory, safetensors files or a plain DCP directory out) and ``import`` (DCP dirs,
safetensors, HF dirs, .pt in).

Apart from ``ckptflow.cli.commands`` because they are the commands over the interop
layer (imported inside each command: it loads torch, which the other commands never
need), with arguments of their own (a shard size).
"""

from __future__ import annotations

import argparse
import re
import sys

from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.cli.commands import UNAVAILABLE, no_such_step, open_existing, require_run
from ckptflow.cli.output import PROG, progress, warn
from ckptflow.errors import (
    DAMAGE,
    CkptflowError,
    CorruptChunkError,
    NewerFormatError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from ckptflow.format import layout as fmt
from ckptflow.lifecycle.lineage import lineage_of
from ckptflow.reports.units import human_bytes
from ckptflow.store import Store, open_store

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(|B|KB|MB|GB|KIB|MIB|GIB)\s*$")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def size_arg(text: str) -> int:
    """``5GB`` (decimal, as transformers counts), ``512MiB``, or a number of bytes."""
    match = _SIZE.match(text.upper())
    if not match or float(match[1]) * _SIZE_UNITS[match[2]] < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} not understood; use e.g. 5GB, 500MB, 2GiB or bytes")
    return int(float(match[1]) * _SIZE_UNITS[match[2]])


def cmd_export(args: argparse.Namespace) -> int:
    from ckptflow.chunks.lossy import describe
    from ckptflow.interop.export import (  # torch, when exporting
        DEFAULT_MAX_SHARD_BYTES,
        ExportOptions,
        export_dcp,
        export_safetensors,
        newest_verified_step,
        read_config,
    )

    store = open_existing(args.root)
    run = require_run(store, args.run)
    if args.format == "dcp":
        given = [flag for flag, value in (("--key", args.key), ("--dtype", args.dtype),
                 ("--allow-fp16-overflow", args.allow_fp16_overflow), ("--max-shard-size", args.max_shard_size),
                 ("--config", args.config)) if value]  # fmt: skip
        if given:
            raise CkptflowError(
                f"{', '.join(given)} apply to model exports (--format hf); --format dcp writes the whole state as saved"
            )
    else:
        options = ExportOptions(
            key=args.key or "model",
            dtype=args.dtype or "",
            allow_fp16_overflow=args.allow_fp16_overflow,
            max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES,
        )
    model_config = read_config(args.config) if args.config else None
    allowed = {"allow_lossy": args.allow_lossy, "allow_failed": args.allow_failed}
    try:
        if args.step is not None:
            steps = [e.step for e in catalog_listing.listing(store, run) if isinstance(e, catalog_listing.StepListing)]
            if fmt.validate_step(args.step) not in steps:
                raise no_such_step(run, args.step, steps)
        skipped: list[tuple[int, str]] = []
        step = args.step
        if step is None:  # a bar of its own: verifying reads the whole checkpoint, the export its tensors
            with progress(f"verify {run}") as report_progress:
                step, skipped = newest_verified_step(store, run, report_progress)
        with progress(f"export {run}") as report_progress:
            if args.format == "dcp":
                result = export_dcp(
                    store, run, args.out, step=fmt.validate_step(step), progress=report_progress, **allowed
                )
            else:
                lineage = lineage_of(store, catalog.read_manifest(store, run, fmt.validate_step(step)))
                result = export_safetensors(
                    store, run, args.out, step=step, options=options, lineage=lineage, progress=report_progress,
                    model_config=model_config, **allowed,
                )  # fmt: skip
    except (StoreUnavailableError, NewerFormatError) as e:  # nothing proved damage: exit as verify does
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return UNAVAILABLE
    except DAMAGE as e:
        if args.step is None:
            raise
        what = f"run {run!r} step {args.step} cannot be exported: "
        repair = (  # repair copies chunk objects, not commit records
            f", or repair this one from another tier's copy (`{PROG} repair ROOT --from URL`)"
            if isinstance(e, CorruptChunkError)
            else ""
        )
        raise CkptflowError(
            f"{what}{str(e).removeprefix(what)}; nothing was written: export another step (without --step: the "
            f"newest that verifies){repair}"
        ) from None
    for skipped_step, why in skipped:
        warn(f"run {run} step {skipped_step} does not verify, skipped: {why}")
    if result.lossy is not None:
        warn(f"run {run} step {result.step} is a lossy archive copy, not the exact checkpoint that was trained")
    if result.failed_validation is not None:
        why = "; ".join(map(str, (result.failed_validation.get("problems") or ["no problem recorded"])[:1]))
        warn(f"run {run} step {result.step} failed validation, exported as asked: {why}")
    what = "state, DCP" if args.format == "dcp" else args.key or "model"
    print(
        f"exported run {run} step {result.step} ({what}): {result.tensors} tensors, "
        f"{human_bytes(result.bytes)} -> {result.path}"
        + (f" ({', '.join(result.files)})" if len(result.files) > 1 else "")
        + (f"; LOSSY copy ({describe(result.lossy)}), marked in every file" if result.lossy is not None else "")
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from ckptflow.chunks.lossy import describe
    from ckptflow.interop.importers import import_checkpoint  # torch, when importing

    store: str | Store
    try:
        store = open_store(args.root, create=False)
    except StoreNotFoundError:
        store = args.root  # created by the commit, once the source is read and checked: a refusal leaves nothing
    except ValueError as e:
        raise CkptflowError(str(e)) from None
    with progress(f"import {args.run}") as report_progress:
        result = import_checkpoint(
            store, args.run, args.step, args.src, format=args.format, allow_failed=args.allow_failed,
            progress=report_progress,
        )  # fmt: skip
    if result.failed_validation is not None:
        warn(
            f"{result.source} was exported despite a failed validation; run {result.run} step {result.step} keeps "
            "that verdict (export and promotion refuse it; validating it again keeps it: validate the source again and "
            "export it anew)"
        )
    print(
        f"imported {result.source} ({result.format}) as run {result.run} step {result.step}: "
        f"entries {', '.join(result.entries)}; {result.tensors} tensors, {human_bytes(result.bytes)}; "
        f"manifest {result.digest[:12]}"
        + (
            f"; left out {', '.join(result.unsaved)}: buffers the model of its config.json does not save (it "
            "rebuilds them), as save_pretrained leaves them out"
            if result.unsaved
            else ""
        )
        + (f"; LOSSY copy ({describe(result.lossy)}): restores only with allow_lossy" if result.lossy else "")
    )
    return 0
