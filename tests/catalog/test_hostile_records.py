"""Hostile or broken records and objects: each is a clear, per-checkpoint problem read with
bounded memory, never an exception that ends a walk or a reader that allocates what a
record claims."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
import torch

from ckptflow import Checkpointer, CkptflowError, gc, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import listing as catalog_listing
from ckptflow.chunks.codecs import HEADER, MAGIC, ZSTD
from ckptflow.format import layout as fmt
from ckptflow.interop.export import export_safetensors
from ckptflow.reports import stats
from support.cli import run_cli
from support.corrupt import chunk_path, manifest_path, only_in, reseal_manifest

RUN = "r"


@pytest.fixture
def root(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN, chunk_bytes=1024) as ck:
        ck.save(1, {"model": {"w": torch.arange(1024, dtype=torch.float32)}})
        ck.save(2, {"model": {"w": torch.arange(1024, dtype=torch.float32) * 2}})
    return root


def restore_step(root) -> tuple[int, list]:
    with Checkpointer(root, RUN) as ck:
        result = ck.restore({"model": {"w": torch.zeros(1024)}})
    return result.step, result.skipped


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("what", ["manifest", "rank record"])
def test_a_200k_deep_record_is_a_problem_not_a_recursion_error(root, tmp_path, capsys, what):
    key = (
        fmt.manifest_key(RUN, 2) if what == "manifest" else catalog.read_manifest(open_store(root), RUN, 2).rank_key(0)
    )
    path = tmp_path / "store" / key
    path.write_bytes(('{"checksum": "x", "a": ' + deep(200_000) + "}").encode())
    step, skipped = restore_step(root)
    assert step == 1 and "nested deeper" in skipped[0][1]
    assert run_cli(capsys, "verify", root, "--run", RUN, "--all")[0] == 1
    code, out, err = run_cli(capsys, "ls", root)
    assert code == 0 and "1" in out
    assert run_cli(capsys, "stats", root)[0] == 0
    gc(root, grace="1h", dry_run=True)  # decides, without a RecursionError
    assert export_safetensors(root, RUN, tmp_path / "m.safetensors").step == 1


def test_a_small_chunk_declaring_gigabytes_is_refused_before_decompressing(root):
    digest = only_in(root, RUN, 2, 1)[0]
    import zstandard

    payload = zstandard.ZstdCompressor().compress(bytes(108 << 10))
    chunk_path(root, digest).write_bytes(HEADER.pack(MAGIC, ZSTD, 1, 3 << 30) + payload)
    tracemalloc.start()
    try:
        report = catalog.verify_checkpoint(open_store(root), RUN, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not report.ok and "announces 3221225472 raw bytes" in report.problems[0]
    assert peak < 32 << 20
    assert restore_step(root)[0] == 1


def test_a_huge_sparse_file_at_a_chunk_path_is_refused_unread(root):
    digest = only_in(root, RUN, 2, 1)[0]
    with open(chunk_path(root, digest), "r+b") as f:
        f.truncate(4 << 30)  # 4 GiB, sparse
    started = time.monotonic()
    tracemalloc.start()
    try:
        report = catalog.verify_checkpoint(open_store(root), RUN, 2)
        step, skipped = restore_step(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 10 and peak < 64 << 20
    assert not report.ok and "4294967296 bytes" in report.problems[0]
    assert step == 1 and "4294967296 bytes" in skipped[0][1]


def test_a_million_ranks_is_one_line_and_quick(root, capsys):
    reseal_manifest(root, RUN, 2, lambda r: r.update(world_size=1_000_000))
    started = time.monotonic()
    code, out, _ = run_cli(capsys, "verify", root, "--run", RUN, "--step", "2")
    assert code == 1 and time.monotonic() - started < 20
    [line] = out.splitlines()
    assert "999999 of 1000000 ranks are missing" in line and "(ranks 1, 2, 3" in line


@pytest.mark.parametrize("when", [1e300, -1.0, "nan"])
def test_a_time_no_tool_can_print_is_a_damaged_manifest_not_an_overflow(root, capsys, when):
    """A sealed manifest whose created_at is past the year 9999: ``ls`` printed a traceback
    (time.localtime overflowed) where verify and export passed it as sound."""
    reseal_manifest(root, RUN, 2, lambda r: r.update(created_at=when))
    for argv in (["ls", root], ["ls", root, "--json"], ["verify", root, "--run", RUN, "--step", "2"]):
        code, out, err = run_cli(capsys, *argv)
        assert "Traceback" not in err and "not a time between 1970 and 9999" in out + err, (argv, out, err)
    step, skipped = restore_step(root)
    assert step == 1 and [s for s, _ in skipped] == [2]


def test_a_shape_no_machine_can_hold_is_a_clear_export_error(root, tmp_path):
    def huge(record):
        n = 1_000_000
        digest = next(iter(record["chunks"]))
        record["chunks"] = {digest: 4 * n * n}
        record["fast_checksums"] = {digest: record["fast_checksums"][digest]}
        record["dcp"]["tensors"] = {
            "model.w": {"dtype": "float32", "size": [n, n], "chunks": [{"offsets": [0, 0], "sizes": [n, n]}]}
        }
        record["dcp"]["items"] = [
            {
                "fqn": "model.w",
                "offset": [0, 0],
                "index": None,
                "dtype": "float32",
                "shape": [n, n],
                "chunks": [[digest, 4 * n * n]],
            }
        ]

    reseal_manifest(root, RUN, 2, huge)
    with pytest.raises(CkptflowError, match=r"declares shape \[1000000, 1000000\] .*cannot be allocated"):
        export_safetensors(root, RUN, tmp_path / "m.safetensors", step=2)
    assert not (tmp_path / "m.safetensors").exists()


def test_a_manifest_larger_than_any_record_is_refused_unread(root):
    with open(manifest_path(root, RUN, 2), "r+b") as f:
        f.truncate(2 << 30)  # sparse, 2 GiB
    problems = [p for p in catalog.committed(open_store(root)) if isinstance(p, catalog_listing.Problem)]
    assert [(p.step, p.kind) for p in problems] == [(2, "too_big")]
    assert stats.store_stats(open_store(root)).checkpoints == 1
    assert restore_step(root)[0] == 1


def test_metadata_that_is_not_json_is_refused_before_any_chunk_is_written(tmp_path):
    import numpy as np

    root = tmp_path / "store"
    with Checkpointer(str(root), RUN) as ck:
        with pytest.raises(CkptflowError, match=r"metadata\['loss'\] is a numpy.float32.*float\(\)"):
            ck.save(1, {"w": torch.ones(4)}, metadata={"loss": np.float32(0.5)})
        assert not (root / "chunks").exists() and not (root / "runs").exists()
        assert ck.save(np.int64(2), {"w": torch.ones(4)}, metadata={"loss": 0.5}).step == 2  # numpy steps are fine
    assert json.loads((root / fmt.manifest_key(RUN, 2)).read_bytes())["step"] == 2


@pytest.mark.parametrize("name", ["Z" * 64, "A" * 64, "a" * 63 + "\n", "a" * 65])
def test_a_chunk_named_by_anything_but_a_digest_is_a_problem(root, name):
    """One rule for a digest (``fmt.is_digest``): a manifest cannot name a chunk key that no
    address could be, however long."""

    def rename_first_chunk(record: dict) -> None:
        chunks = record["chunks"]
        first = next(iter(chunks))
        chunks[name] = chunks.pop(first)

    reseal_manifest(root, RUN, 2, rename_first_chunk)
    problems = [p for p in catalog.committed(open_store(root)) if isinstance(p, catalog_listing.Problem)]
    assert [(p.step, p.kind) for p in problems] == [(2, "corrupt")]
    assert "digest" in problems[0].message
    assert restore_step(root)[0] == 1


def test_is_digest_is_64_lower_case_hex_digits_and_nothing_else():
    assert fmt.is_digest(fmt.digest_of(b"x"))
    assert not any(fmt.is_digest(v) for v in ["A" * 64, "a" * 64 + "\n", "a" * 63, "g" * 64, b"a" * 64, None, 64])
