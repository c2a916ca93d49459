"""ckptflow's DCP StorageWriter under a plain ``dcp.save``: tensors are committed; a non-tensor
value (which DCP would pickle into a BYTE_IO item) is refused naming it and the ways out, and
nothing is committed; the Checkpointer, the first way out, keeps the same value as JSON, and so
does the writer itself when opted in (``json_values=True``), which a plain ``dcp.load`` through
ckptflow's reader gives back as it was: a real optimizer's state included."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptflow import Checkpointer, gc
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.chunks import codecs
from ckptflow.dcp.reader import CheckpointReader
from ckptflow.dcp.save_spec import SaveSpec
from ckptflow.dcp.writer import CheckpointWriter
from ckptflow.errors import ManifestError


def writer(ck: Checkpointer, step: int, *, json_values: bool = False) -> CheckpointWriter:
    spec = SaveSpec(
        run=ck.run, step=step, kind="full", base_step=None, skeleton={}, rng=None, metadata={}, world_size=1,
        save_id=uuid.uuid4().hex,
    )  # fmt: skip
    return CheckpointWriter(ck.chunks, spec, ck.pool, json_values=json_values)


def reader(ck: Checkpointer, step: int) -> CheckpointReader:
    return CheckpointReader(ck.chunks, read_manifest(ck.store, ck.run, step), ck.pool)


def test_a_non_tensor_value_is_refused_with_both_ways_out(tmp_path):
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        with pytest.raises(CheckpointException) as refused:  # DCP's wrapper (a BaseException) of each rank's error
            dcp.save({"w": torch.ones(4), "epoch": 3}, storage_writer=writer(ck, 1), no_dist=True)
        text = str(refused.value)
        assert "'epoch' is not a tensor" in text and "never pickles" in text
        assert "Checkpointer(root, run).save(step, state)" in text and "torch.tensor(value)" in text
        assert "CheckpointWriter(..., json_values=True)" in text
        assert "nothing was committed for run 'plain' step 1" in text
        assert "UnsupportedStateError" in text
        assert ck.list() == []

        state = {"w": torch.ones(4), "epoch": 3}  # the first way out keeps it, as JSON
        ck.save(1, state)
        restored = {"w": torch.zeros(4), "epoch": 0}
        ck.restore(restored)
        assert restored["epoch"] == 3 and torch.equal(restored["w"], torch.ones(4))


def test_tensors_alone_are_committed(tmp_path):
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        w = writer(ck, 2)
        dcp.save({"w": torch.arange(6.0)}, storage_writer=w, no_dist=True)
        assert w.manifest is not None and w.manifest.step == 2


def test_json_values_opted_in_come_back_through_plain_dcp_load(tmp_path):
    state = {
        "w": torch.arange(6.0),
        "epoch": 3,
        "config": {"lr": 0.1, "betas": (0.9, 0.999), "name": "run-a", "layers": [1, 2], "on": True, "none": None},
        "blob": b"\x00raw",
    }
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        dcp.save(state, storage_writer=writer(ck, 1, json_values=True), no_dist=True)
        manifest = read_manifest(ck.store, "plain", 1)
        assert (
            set(manifest.dcp.values)
            == {
                "epoch",
                "config.lr",
                "config.betas",
                "config.name",
                "config.layers",
                "config.on",
                "config.none",
                "blob",
            }
            or "epoch" in manifest.dcp.values
        )
        into = {"w": torch.zeros(6), "epoch": 0, "config": {"lr": 0.0, "betas": (0.0, 0.0), "name": "",
                "layers": [], "on": False, "none": 1}, "blob": b""}  # fmt: skip
        dcp.load(into, storage_reader=reader(ck, 1), no_dist=True)
    assert torch.equal(into["w"], state["w"])
    assert into["epoch"] == 3 and into["blob"] == b"\x00raw"
    assert into["config"] == state["config"] and type(into["config"]["betas"]) is tuple


def test_a_real_optimizer_round_trips_through_plain_dcp_with_json_values(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(32, 8)).pow(2).mean().backward()
        optim.step()
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        saved = {"model": model.state_dict(), "optim": optim.state_dict()}
        dcp.save(saved, storage_writer=writer(ck, 3, json_values=True), no_dist=True)
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1.0)
        fresh_optim.zero_grad()
        fresh(torch.randn(2, 8)).sum().backward()
        fresh_optim.step()  # its state exists, to be overwritten
        into = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict()}
        dcp.load(into, storage_reader=reader(ck, 3), no_dist=True)
    fresh.load_state_dict(into["model"])
    fresh_optim.load_state_dict(into["optim"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    got, want = fresh_optim.state_dict(), optim.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k in want["state"]:
        for name, value in want["state"][k].items():
            assert torch.equal(got["state"][k][name], value), (k, name)


def test_a_value_json_cannot_hold_is_refused_even_opted_in(tmp_path):
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        with pytest.raises(CheckpointException) as refused:
            dcp.save({"w": torch.ones(2), "seen": {1, 2}}, storage_writer=writer(ck, 1, json_values=True), no_dist=True)
        assert "'seen' is a builtins.set" in str(refused.value) or "builtins.set" in str(refused.value)
        assert ck.list() == []


@pytest.mark.parametrize("hostile", [{"__tensor__": "w"}, {"__bytes__": "not base64!"}, {"__odict__": [1]}])
def test_a_manifest_value_that_is_no_plain_value_is_refused_when_parsed(hostile):
    from ckptflow.format.dcp_index import parse_dcp_index
    from ckptflow.format.sealed import Fields

    doc = {"tensors": {}, "items": [], "values": {"v": hostile}}
    with pytest.raises(ManifestError, match="DCP value 'v'"):
        parse_dcp_index(Fields("manifest m"), doc, {})


def test_a_write_during_a_plain_dcp_save_leaves_every_chunk_as_addressed(tmp_path, monkeypatch):
    """Under a plain ``dcp.save`` the writer reads the caller's own tensors: a write to them
    while a chunk is encoded does not reach the stored chunk (the writer's default, ``live``)."""
    w = torch.arange(4096.0)
    before = w.clone()
    real = codecs.encode

    def written_meanwhile(*args, **kwargs):
        w.mul_(-1)
        return real(*args, **kwargs)

    monkeypatch.setattr(codecs, "encode", written_meanwhile)
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        dcp.save({"w": w}, storage_writer=writer(ck, 3), no_dist=True)
        monkeypatch.undo()
        assert ck.verify(3, deep=True).ok
        loaded = {"w": torch.zeros(4096)}
        dcp.load(loaded, storage_reader=reader(ck, 3), no_dist=True)
        assert torch.equal(loaded["w"], before)


def test_a_save_failing_in_finish_before_its_commit_gives_its_lease_back(tmp_path):
    """Under a plain ``dcp.save`` nothing but the writer can release the lease its coordinator
    took when planning: a ``finish`` that fails before the commit (here the manifest cannot
    be sealed: metadata JSON cannot hold) left it held, renewed as long as the process
    lived, and every GC meanwhile skipped its sweep."""
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        spec = SaveSpec(
            run=ck.run, step=1, kind="full", base_step=None, skeleton={}, rng=None, metadata={"tags": {1, 2}},
            world_size=1, save_id=uuid.uuid4().hex,
        )  # fmt: skip
        with pytest.raises(CheckpointException):
            dcp.save({"w": torch.ones(4)}, storage_writer=CheckpointWriter(ck.chunks, spec, ck.pool), no_dist=True)
        assert ck.list() == []
        report = gc(ck.store, grace="1h", wait=0.5)
        assert report.skipped is None and report.live_leases == []
