"""ckptflow's DCP StorageWriter under a plain ``dcp.save``: tensors are committed; a non-tensor
value (which DCP would pickle into a BYTE_IO item) is refused naming it and both ways out, and
nothing is committed; the Checkpointer, the first way out, keeps the same value as JSON."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptflow import Checkpointer
from ckptflow.dcp.writer import CheckpointWriter, SaveSpec


def writer(ck: Checkpointer, step: int) -> CheckpointWriter:
    spec = SaveSpec(
        run=ck.run, step=step, kind="full", base_step=None, skeleton={}, rng=None, metadata={}, world_size=1,
        save_id=uuid.uuid4().hex,
    )  # fmt: skip
    return CheckpointWriter(ck.chunks, spec, ck.pool)


def test_a_non_tensor_value_is_refused_with_both_ways_out(tmp_path):
    with Checkpointer(str(tmp_path / "s"), "plain") as ck:
        with pytest.raises(CheckpointException) as refused:  # DCP's wrapper (a BaseException) of each rank's error
            dcp.save({"w": torch.ones(4), "epoch": 3}, storage_writer=writer(ck, 1), no_dist=True)
        text = str(refused.value)
        assert "'epoch' is not a tensor" in text and "never pickles" in text
        assert "Checkpointer(root, run).save(step, state)" in text and "torch.tensor(value)" in text
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
