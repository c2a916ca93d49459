"""No decoder produces or allocates more than the manifest says a chunk holds, and whatever
goes wrong while decoding bytes that were read is damage (restore falls back, verify exits
1), never "the store could not be read" and never a traceback.

The exhaustive checks (every bit of every zstd frame header, 1 GiB bombs) run in a process
of their own (``support.decode_probe``) so that its peak memory can be measured."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from ckptflow import Checkpointer, CkptflowError, CorruptChunkError, StoreUnavailableError, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.chunks import codecs
from ckptflow.chunks.codecs import BF16, DELTA, HEADER, MAGIC, Q8, ZSTD, ZSTD_V1
from ckptflow.dcp.failures import failure_of
from ckptflow.errors import HostMemoryError
from ckptflow.interop.export.tensors import load_tensors
from ckptflow.lifecycle import scrub, validate
from support import decode_probe
from support.child_env import child_env
from support.cli import run_cli
from support.corrupt import chunk_path, chunks_of, one_plane_zstd_chunk, only_in, reseal_manifest

TESTS = Path(__file__).resolve().parents[1]
RUN = decode_probe.RUN
PLANE = 64 << 10  # the raw bytes a forged chunk announces
GIB = 1 << 30


def _probe(command: str, root: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "support.decode_probe", command, root],
        capture_output=True,
        text=True,
        cwd=TESTS,
        env=child_env(TESTS.parent, TESTS),  # this checkout
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# ---- the acceptance checks: every flipped bit, and bombs --------------------------------------
@pytest.mark.slow  # 1,104 restores and verifies in a subprocess (~30 s): make test-e2e
def test_every_bit_of_every_zstd_frame_header_and_chunk_header_restores_exactly_or_falls_back(tmp_path):
    """Each bit of the chunk header (and a delta's base address) and of the first 16 bytes
    of every zstd frame (zstd planes, window-nibble planes, delta planes) of step 2's own
    chunks, flipped one at a time: restore returns step 2 exactly or falls back to step 1
    exactly; ``verify --step 2`` exits 1, or 0 exactly when restore returned step 2."""
    root = str(tmp_path / "store")
    decode_probe.save(root, decode_probe.flip_state, decode_probe.FLIP_CHUNK)
    summary = _probe("flips", root)
    print(json.dumps(summary))
    assert {"zstd zstd frame", "zstd nibbles frame", "delta zstd frame", "delta header"} <= set(summary["kinds"])
    assert summary["flips"] > 1000 and summary["failures"] == []
    assert summary["outcomes"]["fallback"] > 0.9 * summary["flips"]
    assert set(summary["verify"]) <= {"0", "1"}
    # the state is 16 KiB and a chunk 4 KiB: what remains is the interpreter's own noise
    assert summary["rss_growth_mib"] < 32


def test_a_chunk_whose_zstd_frame_expands_to_a_gibibyte_costs_no_gibibyte(tmp_path):
    """A 64 KiB chunk of the manifest rewritten as a forged one-plane zstd chunk whose frame
    really expands to 1 GiB, with its size in the frame header and without (streamed):
    restore falls back, verify exits 1, and neither allocates anything near 1 GiB."""
    root = str(tmp_path / "store")
    decode_probe.save(root, decode_probe.bomb_state, decode_probe.BOMB_CHUNK)
    summary = _probe("bombs", root)
    print(json.dumps(summary))
    for kind in ("declared", "undeclared"):
        result = summary[kind]
        assert result["frame_bytes"] < decode_probe.BOMB_CHUNK + 2048
        assert result["restore"] == "fallback" and result["verify"] == 1, (kind, result)
        assert result["rss_growth_mib"] < 64 and result["traced_peak_mib"] < 16, (kind, result)


# ---- item 1: every zstd use in reading is bounded by the size it must decode to ----------------
@pytest.fixture(scope="module")
def declared_bomb() -> bytes:
    """A 32 KiB zstd frame whose header declares, and whose blocks hold, 1 GiB of zeros."""
    stream = zstandard.ZstdCompressor(level=1).compressobj(size=GIB)
    zeros = bytes(1 << 20)
    return b"".join(stream.compress(zeros) for _ in range(GIB // len(zeros))) + stream.flush()


def _planes(mode: int, body: bytes) -> bytes:
    """A planes payload of one plane (``ckptflow.chunks.planes``)."""
    return struct.pack("<BB", 0, 1) + struct.pack("<BI", mode, len(body)) + body


def _forged(form: str, frame: bytes) -> tuple[bytes, codecs.BaseReader | None]:
    """A chunk announcing PLANE raw bytes whose decoder meets ``frame`` where ``form`` reads one."""
    base = bytes(codecs.encode(bytes(PLANE), "raw")[0]) + bytes(PLANE)
    digest = bytes(32)
    if form == "zstd plane":
        return HEADER.pack(MAGIC, ZSTD, 1, PLANE) + _planes(1, frame), None
    if form == "nibble plane":
        return HEADER.pack(MAGIC, ZSTD, 1, PLANE) + _planes(2, struct.pack("<BI", 0, len(frame)) + frame), None
    if form == "zstd-v1":
        return HEADER.pack(MAGIC, ZSTD_V1, 1, PLANE) + frame, None
    if form == "bf16":
        return HEADER.pack(MAGIC, BF16, 4, PLANE) + _planes(1, frame), None
    if form == "q8 codes":
        block, values = 64, PLANE // 4
        scales = _planes(0, bytes(values // block * 4))
        head = struct.pack("<II", block, values // block) + struct.pack("<I", len(scales))
        return HEADER.pack(MAGIC, Q8, 4, PLANE) + head + scales + _planes(1, frame), None
    if form == "q8 scales":
        block, values = 1, PLANE // 4
        scales = _planes(1, frame)
        head = struct.pack("<II", block, values) + struct.pack("<I", len(scales))
        return HEADER.pack(MAGIC, Q8, 4, PLANE) + head + scales + _planes(0, bytes(values)), None
    if form == "delta":
        return HEADER.pack(MAGIC, DELTA, 1, PLANE) + digest + _planes(1, frame), lambda _d, _n: base
    if form == "delta base":  # a delta whose base chunk announces 1 GiB and holds the bomb
        delta = HEADER.pack(MAGIC, DELTA, 1, PLANE) + digest + _planes(0, bytes(PLANE))
        bomb_base = HEADER.pack(MAGIC, ZSTD, 1, GIB) + _planes(1, frame)
        return delta, lambda _d, _n: bomb_base
    raise AssertionError(form)


FORMS = ["zstd plane", "nibble plane", "zstd-v1", "bf16", "q8 codes", "q8 scales", "delta", "delta base"]


def _traced(fn) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        fn()
    except BaseException as e:
        return e, tracemalloc.get_traced_memory()[1]
    else:
        return None, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("form", FORMS)
def test_a_frame_declaring_more_than_its_plane_is_refused_before_it_is_decompressed(declared_bomb, form):
    blob, base = _forged(form, declared_bomb)
    error, peak = _traced(lambda: codecs.decode(blob, base, expected=PLANE))
    assert isinstance(error, CorruptChunkError), error
    assert peak < 4 << 20, f"{form}: decoding allocated {peak >> 20} MiB"


def test_a_frame_demanding_a_window_larger_than_its_plane_is_refused():
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27)  # 128 MiB
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = stream.compress(bytes(PLANE)) + stream.flush()
    assert zstandard.get_frame_parameters(frame).window_size == 1 << 27
    with pytest.raises(CorruptChunkError, match="window"):
        codecs.decode(one_plane_zstd_chunk(PLANE, frame), expected=PLANE)


def test_a_frame_without_a_declared_size_decodes_exactly_its_plane():
    data = np.random.default_rng(0).integers(0, 4, PLANE, dtype=np.uint8).tobytes()
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=15)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = stream.compress(data) + stream.flush()
    assert bytes(codecs.decode(one_plane_zstd_chunk(PLANE, frame), expected=PLANE)) == data
    with pytest.raises(CorruptChunkError, match="more than"):
        codecs.decode(one_plane_zstd_chunk(PLANE - 1, frame), expected=PLANE - 1)
    with pytest.raises(CorruptChunkError):
        codecs.decode(one_plane_zstd_chunk(PLANE + 1, frame), expected=PLANE + 1)


def test_a_plane_count_no_encoder_writes_is_refused():
    """Three planes of 3-byte elements: the element size and count agree, yet planes are only
    ever split for 2-, 4- and 8-byte elements (anything else is one plane)."""
    table = struct.pack("<BB", 0, 3) + b"".join(struct.pack("<BI", 0, 2) for _ in range(3))
    blob = HEADER.pack(MAGIC, ZSTD, 3, 6) + table + bytes(6)
    with pytest.raises(CorruptChunkError, match="3 planes for 3-byte elements"):
        codecs.decode(blob, expected=6)


# ---- items 2 and 3: an error while decoding is damage, everywhere ------------------------------
def _raw_then_zstd(root: str) -> None:
    """Step 1 stored raw, step 2 zstd: only step 2 has frames and planes to decode."""
    for step, codec in ((1, "raw"), (2, "zstd")):
        with Checkpointer(root, RUN, codec=codec, chunk_bytes=4096) as ck:
            ck.save(step, {"model": {"w": torch.arange(4096, dtype=torch.float32) * step}})


def _restored_step(root: str) -> tuple[int, list]:
    with Checkpointer(root, RUN) as ck:
        result = ck.restore({"model": {"w": torch.zeros(4096)}})
    return result.step, result.skipped


ERRORS = [
    zstandard.ZstdError("decompression error"),
    ValueError("bad value"),
    struct.error("unpack requires a buffer of 5 bytes"),
    OverflowError("too large"),
    IndexError("index out of range"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_any_error_while_decoding_read_bytes_is_damage_to_every_reader(tmp_path, monkeypatch, capsys, error):
    """Restore, verify, validate, scrub and export read the same verdict from one rule."""
    from ckptflow.errors import is_damage

    root = str(tmp_path / "store")
    _raw_then_zstd(root)

    def broken_join(*_args, **_kwargs):
        raise error

    monkeypatch.setattr("ckptflow.chunks.planes.join", broken_join)
    assert is_damage(error) and failure_of(error).damage
    assert catalog_listing.problem_from(RUN, 2, error).kind == "corrupt"
    step, skipped = _restored_step(root)
    assert step == 1 and type(error).__name__ in skipped[0][1]
    report = catalog.verify_checkpoint(open_store(root), RUN, 2)
    assert report.damaged and not report.unavailable
    assert run_cli(capsys, "verify", root, "--run", RUN, "--step", "2")[0] == 1
    assert validate(open_store(root), RUN, 2)["ok"] is False
    scrubbed = scrub(open_store(root), older_than_s=0)
    assert [(r, s) for r, s, _ in scrubbed.corrupt] == [(RUN, 2)] and not scrubbed.unreadable
    with pytest.raises(CkptflowError) as raised:
        load_tensors(root, RUN, 2)
    assert not isinstance(raised.value, StoreUnavailableError)


def test_running_out_of_memory_while_decoding_is_not_damage_to_any_reader(tmp_path, monkeypatch, capsys):
    """Every allocation is bounded by what the manifest allows, so a MemoryError says the host
    is short of memory: restore stops (no fallback), verify and validate give no verdict,
    scrub counts the checkpoint unreadable, and nothing is recorded as damaged."""
    root = str(tmp_path / "store")
    _raw_then_zstd(root)

    def short_of_memory(*_args, **_kwargs):
        raise MemoryError("Unable to allocate 32.0 MiB")

    monkeypatch.setattr("ckptflow.chunks.planes.join", short_of_memory)
    with pytest.raises(HostMemoryError, match="step 2 .* stopped rather than fall back .* not enough host memory"):
        _restored_step(root)
    report = catalog.verify_checkpoint(open_store(root), RUN, 2)
    assert report.unavailable and not report.damaged
    assert run_cli(capsys, "verify", root, "--run", RUN, "--step", "2")[0] not in (0, 1)
    with pytest.raises(StoreUnavailableError, match="not enough host memory"):
        validate(open_store(root), RUN, 2)
    scrubbed = scrub(open_store(root), older_than_s=0)
    assert not scrubbed.corrupt and len(scrubbed.unreadable) == 1 and "not enough host memory" in scrubbed.unreadable[0]
    assert not os.path.exists(os.path.join(root, "damaged"))


def test_only_failing_to_read_is_an_outage():
    from ckptflow.errors import ColdObjectError, ManifestError, is_damage

    assert is_damage(CorruptChunkError("x")) and is_damage(ManifestError("x"))
    for outage in (OSError("reset"), StoreUnavailableError("503"), ColdObjectError("glacier"), PermissionError()):
        assert not is_damage(outage) and not failure_of(outage).damage


def test_a_record_that_breaks_the_parser_is_damage(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    real = catalog.Manifest.from_json.__func__  # type: ignore[attr-defined]

    def from_json(cls, doc, where, digest=""):
        if doc.get("step") == 2:
            raise TypeError("'NoneType' object is not subscriptable")
        return real(cls, doc, where, digest)

    monkeypatch.setattr(catalog.Manifest, "from_json", classmethod(from_json))
    step, skipped = _restored_step(root)
    assert step == 1 and "TypeError" in skipped[0][1]
    assert run_cli(capsys, "verify", root, "--run", RUN, "--all")[0] == 1


def _frame_demanding_exabytes() -> bytes:
    """A zstd frame whose header declares 2**62 bytes (8-byte content size, single segment)
    and which holds one raw byte: a decoder that trusts the header allocates 4 EiB."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 1 << 62) + bytes([0x09, 0, 0]) + b"\x00"


@pytest.mark.parametrize("mode", [["--step", "2"], [], ["--all"]], ids=["step", "latest", "all"])
def test_a_frame_header_demanding_exabytes_falls_back_and_verify_reports_it(tmp_path, capsys, mode):
    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    digest = only_in(root, RUN, 2, 1)[0]
    raw_len = chunks_of(root, RUN, 2)[digest]
    chunk_path(root, digest).write_bytes(one_plane_zstd_chunk(raw_len, _frame_demanding_exabytes()))
    step, skipped = _restored_step(root)
    assert step == 1 and digest in skipped[0][1]
    code, out, err = run_cli(capsys, "verify", root, "--run", RUN, *mode)
    assert code == 1, err
    assert any(line.startswith(f"run {RUN} step 2:") and digest in line for line in out.splitlines())


# ---- item 7: load() allocates no more than the chunks on disk can hold -----------------------
def test_load_refuses_a_record_naming_a_tensor_its_manifest_lacks_as_damage(tmp_path):
    root = str(tmp_path / "store")
    for step in (1, 2):
        # no packs: with b packed beside w, the pack check refuses the manifest first
        with Checkpointer(root, RUN, chunk_bytes=4096, pack_bytes=0) as ck:
            ck.save(step, {"model": {"w": torch.ones(64) * step, "b": torch.ones(8) * step}})

    def without_b(record):
        del record["dcp"]["tensors"]["model.b"]
        record["dcp"]["items"] = [i for i in record["dcp"]["items"] if i["fqn"] != "model.b"]

    reseal_manifest(root, RUN, 2, without_b)
    with Checkpointer(root, RUN) as ck:
        result, state = ck.load()
    assert result.step == 1 and torch.equal(state["model"]["b"], torch.ones(8))
    assert "model.b" in result.skipped[0][1]


# ---- item 8: verify says the store could not be read when a listing fails -------------------
@pytest.mark.parametrize("mode", [["--step", "2"], [], ["--all"]], ids=["step", "latest", "all"])
@pytest.mark.parametrize("listing", ["runs/", f"runs/{RUN}/checkpoints/"], ids=["runs", "run"])
def test_verify_exits_3_when_a_listing_fails(tmp_path, monkeypatch, capsys, mode, listing):
    from support.faulty_store import FaultyStore

    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    faulty = FaultyStore(open_store(root))
    faulty.fail_if = lambda op, key: op in ("list", "list_after") and key == listing
    monkeypatch.setattr("ckptflow.cli.commands.open_store", lambda *_a, **_k: faulty)
    code, out, err = run_cli(capsys, "verify", root, "--run", RUN, *mode)
    assert code == 3, (out, err)
    assert "could not be read" in err and "injected fault" in err
    assert "has no step" not in err and "no committed checkpoints" not in err
