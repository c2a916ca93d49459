"""Results and report for benchmarks/save_restore.py: one median ``Row`` per method, the
Markdown table (each figure also as a ratio to torch.save), and the performance-floor
checks (ckptflow within ``FLOOR`` x of DCP).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from _states import MiB

FLOOR = 1.5  # ckptflow must stay within this factor of DCP (see the floor checks)
ASYNC = "ckptflow save (full, async)"
CLONE = "host copy (clone) of the state"
DD = "one file, write + fsync (dd-style)"
INCREMENTAL = "ckptflow save (incremental)"
DEEP = "ckptflow verify --deep (blake3)"
SAFETENSORS = "safetensors save_file / load_file"
DCP_SYNC = "DCP FileSystemWriter / dcp.load"
SYNC = "ckptflow save (full) / restore"
SINGLE_PASS = "ckptflow restore, single pass"
ZSTD = "ckptflow save (full, zstd)"


# ---- results ----------------------------------------------------------------------------
@dataclass
class Row:
    method: str
    blocked_s: float | None
    total_s: float | None
    bytes: int | None
    restore_s: float | None
    save_cpu_s: float | None  # CPU seconds the process spent on the save, all threads
    restore_cpu_s: float | None = None  # the same for the restore
    warm_blocked_s: float | None = None  # async: the second save of the same Checkpointer
    note: str = ""
    peak_rss: int | None = None  # bytes: the most resident memory beyond what the process held before the method
    cold_restore_s: float | None = None  # the restore again with the files evicted from the page cache


Sample = dict[str, float]  # blocked, total, bytes, restore, cpu (any may be missing)


def median_row(method: str, note: str, samples: list[Sample]) -> Row:
    def med(key: str) -> float | None:
        vals = [s[key] for s in samples if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    nbytes = med("bytes")
    return Row(
        method,
        med("blocked"),
        med("total"),
        None if nbytes is None else int(nbytes),
        med("restore"),
        med("cpu"),
        med("restore_cpu"),
        med("warm_blocked"),
        note,
        None if med("peak_rss") is None else int(med("peak_rss") or 0),
        med("cold_restore"),
    )


# ---- report -----------------------------------------------------------------------------
def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f} MiB"


def table(rows: list[Row]) -> str:
    base = rows[0]
    header = [
        "method",
        "blocked s",
        "x torch",
        "total s",
        "x torch",
        "bytes on disk",
        "x torch",
        "restore s",
        "x torch",
        "cold restore s",
        "x torch",
        "save cpu s",
        "restore cpu s",
        "peak +RSS",
        "note",
    ]
    body = [
        [
            r.method,
            _secs(r.blocked_s),
            _ratio(r.blocked_s, base.blocked_s),
            _secs(r.total_s),
            _ratio(r.total_s, base.total_s),
            _mib(r.bytes),
            _ratio(r.bytes, base.bytes),
            _secs(r.restore_s),
            _ratio(r.restore_s, base.restore_s),
            _secs(r.cold_restore_s),
            _ratio(r.cold_restore_s, base.cold_restore_s),
            _secs(r.save_cpu_s),
            _secs(r.restore_cpu_s),
            _mib(r.peak_rss),
            r.note,
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    left = {0, len(header) - 1}

    def fmt(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 1) + ":" if i not in left else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])


def floor_checks(rows: list[Row]) -> list[dict]:
    by = {r.method: r for r in rows}
    specs = [
        ("ckptflow sync full total vs DCP FileSystemWriter total", by[SYNC].total_s, by[DCP_SYNC].total_s),
        ("ckptflow async blocked vs DCP async_save blocked", by[ASYNC].blocked_s, by["DCP async_save"].blocked_s),
        ("ckptflow restore vs DCP load", by[SYNC].restore_s, by[DCP_SYNC].restore_s),
    ]
    return [_check(name, ours, theirs, FLOOR) for name, ours, theirs in specs]


def target_checks(rows: list[Row], state_bytes: int) -> list[dict]:
    """The speed targets of issues 15 and 25, each a ratio within one run (restore from zstd
    against the time ``state_bytes`` take at 1 GB/s)."""
    by = {r.method: r for r in rows}
    sync, clone = by[SYNC], by[CLONE].blocked_s
    specs = [
        ("verified restore vs safetensors load_file + copy", sync.restore_s, by[SAFETENSORS].restore_s, 2.0),
        ("the same, both from the disk (cold)", sync.cold_restore_s, by[SAFETENSORS].cold_restore_s, 2.0),
        ("single-pass restore vs safetensors", by[SINGLE_PASS].restore_s, by[SAFETENSORS].restore_s, 2.0),
        ("verified restore vs DCP load", sync.restore_s, by[DCP_SYNC].restore_s, 0.5),
        ("sync full save vs safetensors save_file + fsync", sync.total_s, by[SAFETENSORS].total_s, 1.0),
        ("sync full save vs dd write+fsync", sync.total_s, by[DD].total_s, 1.1),
        ("sync full save vs DCP save", sync.total_s, by[DCP_SYNC].total_s, 1.0),
        ("incremental save (1% of bytes changed) vs full save", by[INCREMENTAL].total_s, sync.total_s, 0.10),
        ("save cpu vs DCP save cpu", sync.save_cpu_s, by[DCP_SYNC].save_cpu_s, 1.0),
        ("first async save blocked (after prepare) vs clone", by[ASYNC].blocked_s, clone, 1.2),
        ("later async save blocked vs clone", by[ASYNC].warm_blocked_s, clone, 0.5),
        ("restore from zstd vs the state at 1 GB/s", by[ZSTD].restore_s, state_bytes / 1e9, 1.0),
    ]
    return [_check(name, ours, theirs, limit) for name, ours, theirs, limit in specs]


def _check(name: str, ours: float | None, theirs: float | None, limit: float) -> dict:
    ratio = ours / theirs if ours is not None and theirs else float("inf")
    return {"check": name, "ckptflow_s": ours, "dcp_s": theirs, "ratio": ratio, "limit": limit, "pass": ratio <= limit}


def method_notes(*, baseline_fsync: bool) -> str:
    """What each row did, printed under the table (so the ratios are read as measured)."""
    fsynced = (
        "are followed by an fsync of the file and its directory."
        if baseline_fsync
        else "are NOT fsynced (--no-baseline-fsync)."
    )
    return "\n".join(
        [
            "",
            "'restore s': the files are in the page cache (just written). 'cold restore s': the same restore",
            "again after the files were evicted from it (sync, then posix_fadvise DONTNEED on each file), so",
            "it reads the disk, as a restore on another node or after a reboot does.",
            "ckptflow fsyncs every chunk and its commit record; DCP's FileSystemWriter fsyncs its files",
            "(sync_files=True, the default);",
            f"torch.save / safetensors {fsynced}",
            "torch.load / load_file restores include the copy into the live tensors (as load_state_dict does).",
            "ckptflow restore checks every chunk it reads against the fast checksum its manifest records",
            "(xxh3-128 + 64-bit word sum); 'verify --deep' re-hashes the BLAKE3 addresses.",
            "cpu columns count all threads.",
            "",
        ]
    )


def check_lines(checks: list[dict], targets: list[dict]) -> str:
    """The floor and the targets, a PASS/FAIL line each."""
    lines = []
    for title, group in (
        (f"Performance floor (ckptflow <= {FLOOR}x DCP):", checks),
        ("Targets (issues 15, 25):", targets),
    ):
        lines.append(title)
        lines += [
            f"  {'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {c['ratio']:.2f}x (limit {c['limit']}x; "
            f"{_secs(c['ckptflow_s'])} s vs {_secs(c['dcp_s'])} s)"
            for c in group
        ]
    return "\n".join(lines)
