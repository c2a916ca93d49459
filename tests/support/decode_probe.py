"""Damaged and hostile zstd frames against restore and verify, in a process of its own so
that its peak memory is its own: ``python -m support.decode_probe flips|bombs ROOT`` prints
a JSON summary (what each attempt did, and the peak memory it took) for the test to check.

Peak memory is measured twice: the growth of the process's peak resident set (VmHWM,
reset through ``/proc/self/clear_refs`` once warmed up) and the peak of what Python and
numpy allocated (``tracemalloc``; it also sees an allocation nothing touched yet).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import zstandard

from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.cli import main as cli
from ckptflow.store import open_store
from support.corrupt import chunk_path, codec_of, flip_bit, one_plane_zstd_chunk, only_in, zstd_frames
from support.states import assert_tensors_equal, blank_like

RUN = "r"
FLIP_CHUNK = 4 << 10  # bytes: small chunks keep each of a thousand restores quick
BOMB_CHUNK = 64 << 10
BOMB_BYTES = 1 << 30  # what a forged frame of a BOMB_CHUNK chunk really expands to
FRAME_HEAD = 16  # bytes of each frame whose every bit is flipped: its header and first block header


def flip_state(step: int) -> dict:
    """One chunk of each kind the decoder reads zstd frames in, at step 2: fp32 weights
    that drift a little (a delta), fp32 values drawn anew (zstd planes), bf16 weights
    (a window-nibbles exponent plane)."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(1024, generator=gen) * 0.02 + torch.randn(1024, generator=gen) * 1e-5 * step,
            "noise": torch.randn(1024, generator=torch.Generator().manual_seed(step)) * 0.02,
            "bf": (torch.randn(2048, generator=torch.Generator().manual_seed(100 + step)) * 0.02).to(torch.bfloat16),
        }
    }


def bomb_state(step: int) -> dict:
    return {"model": {"w": torch.randn(BOMB_CHUNK // 4, generator=torch.Generator().manual_seed(step))}}


def save(root: str, state: Callable[[int], dict], chunk_bytes: int) -> None:
    with Checkpointer(root, RUN, codec="auto", chunk_bytes=chunk_bytes) as ck:
        ck.save(1, state(1), kind="full")
        ck.save(2, state(2), kind="incremental")


# ---- what one attempt did ------------------------------------------------------------------
def restore_outcome(root: str, state: Callable[[int], dict]) -> str:
    """ "exact" (step 2, bit for bit), "fallback" (step 1, bit for bit), or what went wrong."""
    target = blank_like(state(2))
    try:
        with Checkpointer(root, RUN) as ck:
            step = ck.restore(target).step
        assert_tensors_equal(state(step), target)
    except AssertionError as e:
        return f"restore returned wrong bytes: {e}"
    except Exception as e:
        return f"restore raised {type(e).__name__}: {str(e)[:200]}"
    return {2: "exact", 1: "fallback"}.get(step, f"restored step {step}")


def verify_code(root: str, *mode: str) -> int | str:
    """The exit status of ``ckptflow verify``, or the exception it died with."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return cli(["verify", root, "--run", RUN, *mode])
    except Exception as e:
        return f"verify raised {type(e).__name__}: {str(e)[:200]}"


# ---- peak memory -----------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


@contextlib.contextmanager
def peak_memory(out: dict, *, traced: bool) -> Iterator[None]:
    """Fill ``out`` with the peak growth (MiB) of the resident set and, if ``traced``, of
    traced allocations (which slows a loop of a thousand restores from seconds to minutes)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss = _status_kib("VmRSS")
    if traced:
        tracemalloc.start()
    try:
        yield
    finally:
        if traced:
            out["traced_peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
            tracemalloc.stop()
        out["rss_growth_mib"] = round((_status_kib("VmHWM") - rss) / 1024, 1)


# ---- every bit of every frame header --------------------------------------------------------
def flip_targets(root: str) -> list[tuple[Path, str, int]]:
    """``(chunk file, what, byte offset)`` for each byte to damage in step 2's own chunks:
    the chunk header, a delta's base address, the first bytes of every zstd frame."""
    targets = []
    for digest in only_in(root, RUN, 2, 1):
        path = chunk_path(root, digest)
        blob = path.read_bytes()
        codec = codec_of(blob)
        if codec not in ("zstd", "delta"):
            continue
        targets += [(path, f"{codec} header", i) for i in range(14 + (32 if codec == "delta" else 0))]
        for offset, length, mode in zstd_frames(blob):
            targets += [(path, f"{codec} {mode} frame", offset + i) for i in range(min(FRAME_HEAD, length))]
    return targets


def flips(root: str) -> dict:
    targets = flip_targets(root)
    summary: dict = {"flips": 0, "outcomes": Counter(), "verify": Counter(), "failures": [], "kinds": Counter()}
    summary["kinds"].update(what for _, what, _ in targets)
    assert restore_outcome(root, flip_state) == "exact" and verify_code(root, "--step", "2") == 0  # warm
    with peak_memory(summary, traced=False):
        for path, what, offset in targets:
            for bit in range(8):
                flip_bit(path, offset, bit)
                try:
                    outcome = restore_outcome(root, flip_state)
                    code = verify_code(root, "--step", "2")
                finally:
                    flip_bit(path, offset, bit)
                summary["flips"] += 1
                summary["outcomes"][outcome if outcome in ("exact", "fallback") else "wrong"] += 1
                summary["verify"][str(code)] += 1
                if outcome not in ("exact", "fallback") or code not in (0, 1) or (code == 0) != (outcome == "exact"):
                    summary["failures"].append(f"{what} byte {offset} bit {bit}: {outcome}; verify {code}")
    return summary


# ---- decompression bombs ----------------------------------------------------------------------
def bomb_frame(*, declared: bool) -> bytes:
    """A zstd frame of zeros that really expands to ``BOMB_BYTES``: with its content size in
    the header, or streamed without one (a 64 KiB window: as large as the plane it claims
    to be, so only a bounded decoder stops it)."""
    if declared:
        compressor = zstandard.ZstdCompressor(level=1)
        stream = compressor.compressobj(size=BOMB_BYTES)
    else:
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=16)
        stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    zeros = bytes(1 << 20)
    frame = b"".join(stream.compress(zeros) for _ in range(BOMB_BYTES // len(zeros))) + stream.flush()
    params_read = zstandard.get_frame_parameters(frame)
    assert (params_read.content_size == BOMB_BYTES) == declared
    return frame


def bombs(root: str) -> dict:
    (digest,) = only_in(root, RUN, 2, 1)
    raw_len = catalog.read_manifest(open_store(root), RUN, 2).chunks[digest]
    path = chunk_path(root, digest)
    original = path.read_bytes()
    assert restore_outcome(root, bomb_state) == "exact" and verify_code(root) == 0  # warm
    summary: dict = {}
    for declared in (True, False):
        frame = bomb_frame(declared=declared)
        path.write_bytes(one_plane_zstd_chunk(raw_len, frame))
        result: dict = {"frame_bytes": len(frame)}
        try:
            with peak_memory(result, traced=True):
                result["restore"] = restore_outcome(root, bomb_state)
                result["verify"] = verify_code(root)
        finally:
            path.write_bytes(original)
        summary["declared" if declared else "undeclared"] = result
    return summary


if __name__ == "__main__":
    command, root = sys.argv[1:3]
    print(json.dumps({"flips": flips, "bombs": bombs}[command](root)))
