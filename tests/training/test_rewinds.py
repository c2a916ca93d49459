"""A restore to an older step than the run's newest whole checkpoint warns at once that
saves of the newer steps will be refused (``ckptflow.training.rewinds``)."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptflow import Checkpointer, lifecycle
from ckptflow.errors import CheckpointExistsError
from support.corrupt import corrupt_chunk

NEWER = "holds newer checkpoints"


def saved(root: str, steps=(1, 2, 3, 4)) -> None:
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        for step in steps:
            torch.manual_seed(step)
            ck.save(step, {"w": torch.randn(2048)})


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NEWER in r.getMessage()]


def test_a_restore_of_an_older_step_names_the_newer_steps_a_save_cannot_replace(tmp_path, caplog):
    """Before: nothing was said until the job's save of step 3, after all the work since step 2."""
    root = str(tmp_path / "store")
    saved(root)
    caplog.set_level(logging.WARNING, logger="ckptflow")
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        assert ck.restore({"w": torch.zeros(2048)}, step=2).step == 2
        [warning] = warnings_of(caplog)
        assert "resumed from step 2" in warning and "(steps 3, 4)" in warning and "new run name" in warning
        with pytest.raises(CheckpointExistsError):
            ck.save(3, {"w": torch.zeros(2048)})


def test_the_newest_whole_checkpoint_and_replaceable_steps_are_not_warned_of(tmp_path, caplog):
    root = str(tmp_path / "store")
    saved(root)
    caplog.set_level(logging.WARNING, logger="ckptflow")
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        assert ck.restore({"w": torch.zeros(2048)}).step == 4
        assert ck.restore({"w": torch.zeros(2048)}, step=4).step == 4
    assert warnings_of(caplog) == []
    store = Checkpointer(root, "r").store
    assert lifecycle.validate(store, "r", 2)["ok"]
    corrupt_chunk(root, "r", 4)
    assert not lifecycle.validate(store, "r", 4)["ok"]  # failed validation: a save replaces it
    with Checkpointer(root, "r", chunk_bytes=4096) as ck:
        assert ck.restore({"w": torch.zeros(2048)}, select="validated").step == 2
        [warning] = warnings_of(caplog)
        assert "(step 3)" in warning  # step 3 is whole, merely not validated
        ck.save(3 + 1, {"w": torch.zeros(2048)})  # step 4 is replaced, as before
