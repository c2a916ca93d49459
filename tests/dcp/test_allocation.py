"""Tensors allocated from a manifest's declared shapes (``load()``, export): a shape its
chunks on disk cannot hold is damage (fall back), one they can hold but this machine
cannot is a clear error, and a shape beyond this machine's memory is judged before
``torch.empty``, which succeeds for terabytes where the kernel overcommits."""

from __future__ import annotations

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.dcp import allocation
from ckptflow.errors import HostMemoryError, NoValidCheckpointError
from support.corrupt import reseal_manifest

RUN = "r"
N = 1_000_000  # a declared [N, N] float32 tensor: 4 TB


def _raw_then_zstd(root: str) -> None:
    """Step 1 stored raw, step 2 zstd; 16 KiB of weights each."""
    for step, codec in ((1, "raw"), (2, "zstd")):
        with Checkpointer(root, RUN, codec=codec, chunk_bytes=4096) as ck:
            ck.save(step, {"model": {"w": torch.arange(4096, dtype=torch.float32) * step}})


def _declared_huge(record: dict) -> None:
    """Step 2's manifest, resealed declaring its one tensor [N, N] in one chunk of 4 N² bytes."""
    digest = next(iter(record["chunks"]))
    record["chunks"] = {digest: 4 * N * N}
    record["fast_checksums"] = {digest: record["fast_checksums"][digest]}
    record.pop("stored_checksums", None)
    record["dcp"]["tensors"] = {
        "model.w": {"dtype": "float32", "size": [N, N], "chunks": [{"offsets": [0, 0], "sizes": [N, N]}]}
    }
    item = {"fqn": "model.w", "offset": [0, 0], "index": None, "dtype": "float32", "shape": [N, N]}
    record["dcp"]["items"] = [{**item, "chunks": [[digest, 4 * N * N]]}]


def test_load_refuses_a_shape_its_chunks_cannot_hold_as_damage(tmp_path):
    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    reseal_manifest(root, RUN, 2, _declared_huge)
    with Checkpointer(root, RUN) as ck:
        result, state = ck.load()
    assert result.step == 1 and torch.equal(state["model"]["w"], torch.arange(4096, dtype=torch.float32))
    assert "4000000000000 bytes" in result.skipped[0][1] and "hold at most" in result.skipped[0][1]


def test_a_shape_beyond_this_machines_memory_is_judged_before_allocating(tmp_path, monkeypatch):
    """The GPU machine's image overcommits: there ``torch.empty`` of 4 TB succeeded and the
    test above failed. A stand-in allocator that always succeeds shows the shape is judged
    before it is called."""
    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    reseal_manifest(root, RUN, 2, _declared_huge)
    real_empty, huge_calls = torch.empty, []

    def overcommitting_empty(*size, **kwargs):
        if list(size[0] if len(size) == 1 else size) == [N, N]:
            huge_calls.append(size)
            return real_empty(0, **kwargs)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", overcommitting_empty)
    monkeypatch.setattr(allocation, "_physical_memory", lambda: 1 << 40)
    with Checkpointer(root, RUN) as ck, pytest.raises(NoValidCheckpointError, match="hold at most"):
        ck.load(step=2)
    assert huge_calls == []


def test_a_sound_tensor_larger_than_this_machines_memory_asks_for_a_larger_machine(tmp_path, monkeypatch):
    """The chunks can hold the declared shape: not damage, so no fallback to an older step."""
    root = str(tmp_path / "store")
    _raw_then_zstd(root)
    monkeypatch.setattr(allocation, "_physical_memory", lambda: 1024)
    with Checkpointer(root, RUN) as ck, pytest.raises(HostMemoryError, match="more memory") as raised:
        ck.load()
    assert "16384 bytes" in str(raised.value) and "restore()" in str(raised.value)
