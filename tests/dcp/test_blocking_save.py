"""A blocking save skips ``dcp.save``'s per-key pass (``ckptflow.dcp.blocking_save``): it
must write exactly what ``dcp.save`` writes, so a torch upgrade that changes what comes
after that pass fails here."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from ckptflow import Checkpointer
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.store import open_store


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(64, 16, generator=gen),
            "layers": [{"w": torch.randn(16, 16, generator=gen), "b": torch.zeros(16)} for _ in range(3)],
            "scale": torch.tensor(2.5),
            "half": torch.randn(8, generator=gen).to(torch.bfloat16),
            "empty": torch.empty(0, 4),
        },
        "step": 7,
    }


def _through_dcp_save(tensors, writer, group) -> None:
    dcp.save(tensors, storage_writer=writer, process_group=group.pg, no_dist=not group.active)


def _save(root: str) -> None:
    with Checkpointer(root, "r", chunk_bytes=1024) as ck:
        ck.save(1, _state(), rng=False)


def test_the_direct_call_writes_what_dcp_save_writes(tmp_path, monkeypatch):
    _save(str(tmp_path / "direct"))
    monkeypatch.setattr("ckptflow.training.checkpointer.save_tensors", _through_dcp_save)
    _save(str(tmp_path / "dcp_save"))
    direct, through = (read_manifest(open_store(str(tmp_path / n)), "r", 1) for n in ("direct", "dcp_save"))
    assert direct.dcp.to_json() == through.dcp.to_json()
    assert direct.chunks == through.chunks and direct.fast_checksums == through.fast_checksums
    live = _state()
    for tensor in (live["model"]["embed.weight"], live["model"]["scale"]):
        tensor.zero_()
    with Checkpointer(str(tmp_path / "direct"), "r") as ck:
        ck.restore(live)
    expected = _state()
    assert torch.equal(live["model"]["embed.weight"], expected["model"]["embed.weight"])
    assert torch.equal(live["model"]["scale"], expected["model"]["scale"])
