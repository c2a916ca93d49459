"""Item 8 of issue 9: PyTorch Lightning through ``CkptflowIO``, with the real Lightning on CPU.

A tiny model trains with shuffled data and dropout (so the RNG matters) while
``ModelCheckpoint`` saves through ckptflow; the run is killed mid-epoch, a new Trainer
(another seed, another initialisation) resumes with ``ckpt_path="last"``, and the
losses of every step after the checkpoint are bit-equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections import OrderedDict
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from ckptflow import Checkpointer, CkptflowError, UnsupportedStateError, lifecycle
from ckptflow.catalog import recovery_log
from ckptflow.integrations.lightning import CkptflowIO
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, only_in
from support.lightning_models import (
    EPOCHS,
    STEPS_PER_EPOCH,
    Tiny,
    data,
    quiet,  # noqa: F401  (an autouse fixture)
)


def trainer(
    root, run: str, dirpath, max_epochs: int = EPOCHS, checkpointing: bool = True, select="latest"
) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=max_epochs,
        plugins=[CkptflowIO(str(root), run, select=select)],
        callbacks=[ModelCheckpoint(dirpath=str(dirpath), save_last=True)] if checkpointing else [],
        enable_checkpointing=checkpointing,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def uninterrupted(tmp_path) -> tuple[torch.Tensor, dict]:
    pl.seed_everything(0)
    model = Tiny()
    trainer(tmp_path / "store", "full", tmp_path / "full").fit(model, data())
    return torch.stack(model.losses), model.state_dict()


def killed_at(tmp_path, step: int, run: str = "part") -> Tiny:
    pl.seed_everything(0)
    model = Tiny(crash_at=step)
    with pytest.raises(RuntimeError, match="killed"):
        trainer(tmp_path / "store", run, tmp_path / run).fit(model, data())
    return model


def resumed(tmp_path, run: str = "part", select="latest") -> Tiny:
    pl.seed_everything(123)  # another seed and initialisation: only the checkpoint may carry the run on
    model = Tiny()
    trainer(tmp_path / "store", run, tmp_path / run, select=select).fit(model, data(), ckpt_path="last")
    return model


def test_killed_run_resumes_bit_for_bit(tmp_path):
    full_losses, full_weights = uninterrupted(tmp_path)
    assert len(full_losses) == EPOCHS * STEPS_PER_EPOCH

    crashed = killed_at(tmp_path, 2 * STEPS_PER_EPOCH + 4)  # mid-epoch 2, after epoch 1's checkpoint
    pointer = json.loads((tmp_path / "part" / "last.ckpt").read_text())
    assert pointer["step"] == 2 * STEPS_PER_EPOCH and pointer["run"] == "part"
    assert sorted(os.listdir(tmp_path / "part")) == ["epoch=1-step=16.ckpt", "last.ckpt"]  # top-1 removed epoch 0's
    assert torch.equal(torch.stack(crashed.losses), full_losses[: 2 * STEPS_PER_EPOCH + 4])

    model = resumed(tmp_path)
    losses = torch.stack(model.losses)
    assert torch.equal(losses, full_losses[2 * STEPS_PER_EPOCH :])  # bit for bit
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, full_weights[name]), name
    with Checkpointer(str(tmp_path / "store"), "part") as ck:
        assert [i.step for i in ck.list()] == [8, 16, 24, 32]  # one commit per step, last.ckpt included


def test_last_falls_back_past_a_damaged_checkpoint_and_saves_over_it(tmp_path, caplog):
    full_losses, _ = uninterrupted(tmp_path)
    killed_at(tmp_path, 3 * STEPS_PER_EPOCH + 2)
    root = tmp_path / "store"
    corrupt_chunk(root, "part", 24, only_in(root, "part", 24, 8, 16)[0])

    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        model = resumed(tmp_path)
    assert "resuming from step 16" in caplog.text
    assert torch.equal(torch.stack(model.losses), full_losses[2 * STEPS_PER_EPOCH :])
    with Checkpointer(str(root), "part") as ck:
        assert ck.verify(24).ok  # the damaged step was saved again


def test_last_resumes_to_the_newest_validated_checkpoint(tmp_path):
    full_losses, _ = uninterrupted(tmp_path)
    killed_at(tmp_path, 3 * STEPS_PER_EPOCH + 2)  # checkpoints at 8, 16, 24
    root = tmp_path / "store"
    for step in (24, 16):
        corrupt_chunk(root, "part", step, only_in(root, "part", step, 8)[0])
    store = open_store(str(root))
    assert [lifecycle.validate(store, "part", s)["ok"] for s in (8, 16, 24)] == [True, False, False]

    model = resumed(tmp_path, select="validated")
    assert torch.equal(torch.stack(model.losses), full_losses[STEPS_PER_EPOCH:])  # from step 8
    [record] = recovery_log.read_all(store, "part")
    assert record["select"] == "validated" and record["step"] == 8 and record["skipped"] == []  # never tried
    assert [s for s, _ in record["passed_over"]] == [24, 16]


def test_checkpoint_dict_comes_back_as_lightning_made_it(tmp_path):
    pl.seed_everything(0)
    model = Tiny()
    t = trainer(tmp_path / "store", "r", tmp_path / "ckpts", max_epochs=1, checkpointing=False)
    t.fit(model, data())
    made = t._checkpoint_connector.dump_checkpoint()
    t.save_checkpoint(tmp_path / "manual.ckpt")
    loaded = CkptflowIO(str(tmp_path / "store"), "r").load_checkpoint(tmp_path / "manual.ckpt")
    assert list(loaded) == list(made) and loaded["global_step"] == STEPS_PER_EPOCH
    assert type(loaded["state_dict"]) is OrderedDict and list(loaded["state_dict"]) == list(made["state_dict"])
    optim = loaded["optimizer_states"][0]
    assert list(optim["state"]) == [0, 1, 2, 3] and optim["param_groups"][0]["betas"] == (0.9, 0.999)
    assert loaded["loops"] == made["loops"] and loaded["hyper_parameters"] == {"lr": 0.05}
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in made["state_dict"].items())


def test_saves_at_one_step_share_its_commit(tmp_path):
    """ModelCheckpoint's top-k file and last.ckpt, and a manual save after fit, all at step
    8: one commit, three pointers to it (the dict of the first save at that step)."""
    pl.seed_everything(0)
    t = trainer(tmp_path / "store", "r", tmp_path / "ckpts", max_epochs=1)
    t.fit(Tiny(), data())
    t.save_checkpoint(tmp_path / "manual.ckpt")
    pointers = [json.loads(p.read_text()) for p in (tmp_path / "ckpts").iterdir()]
    pointers.append(json.loads((tmp_path / "manual.ckpt").read_text()))
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        (info,) = ck.list()
    assert len(pointers) == 3 and {(p["step"], p["manifest_digest"]) for p in pointers} == {(8, info.digest)}


class WithPath(Tiny):
    def __init__(self, data_dir: Path = Path("/data")):
        super().__init__()
        self.save_hyperparameters()


def test_a_value_that_needs_pickle_is_refused_naming_it(tmp_path):
    t = trainer(tmp_path / "store", "r", tmp_path / "ckpts", max_epochs=1)
    with pytest.raises(UnsupportedStateError, match=r"hyper_parameters\.data_dir.*PosixPath.*save_hyperparameters"):
        t.fit(WithPath(), data())
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        assert ck.list() == []  # nothing committed
    assert not (tmp_path / "ckpts").exists() or os.listdir(tmp_path / "ckpts") == []


def test_a_pickled_ckpt_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "evil": PlantsMarker(str(marker))}, tmp_path / "torch.ckpt")
    with pytest.raises(CkptflowError, match="not a checkpoint written by CkptflowIO.*ckptflow import"):
        CkptflowIO(str(tmp_path / "store"), "r").load_checkpoint(tmp_path / "torch.ckpt")
    assert not marker.exists()


def test_a_weights_file_that_fails_to_write_leaves_the_one_there(tmp_path, monkeypatch):
    """ddp_spawn's weights file was written in place: a failure (a full disk, a kill)
    mid-write left a truncated file where a good one was."""
    io = CkptflowIO(str(tmp_path / "store"), "r")
    path = tmp_path / "weights.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    before = path.read_bytes()

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fsspec.implementations.local.LocalFileSystem.mv", no_room)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"w": torch.zeros(3)}, path)
    assert path.read_bytes() == before
    assert [name for name in os.listdir(tmp_path) if ".tmp-" in name] == []  # nothing left behind
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(3))


class PlantsMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def test_a_fresh_run_into_a_used_run_name_says_how_to_resume(tmp_path):
    pl.seed_everything(0)
    trainer(tmp_path / "store", "r", tmp_path / "a", max_epochs=1).fit(Tiny(), data())
    with pytest.raises(CkptflowError, match="ckpt_path='last'.*new run name"):
        trainer(tmp_path / "store", "r", tmp_path / "b", max_epochs=1).fit(Tiny(), data())


@pytest.mark.slow  # two ddp_spawn fits, each starting 2 processes that import torch and Lightning: make test-e2e
def test_two_process_ddp_saves_from_rank_zero_and_resumes(tmp_path, monkeypatch):
    """``ddp_spawn`` on 2 CPU processes (gloo): Lightning saves from rank 0 only (the
    plugin's Checkpointer is local, so no collective waits for rank 1), both ranks load,
    and ``ddp_spawn`` hands the weights back to the main process through the plugin
    (as safetensors). Resuming run "a"'s epoch-2 checkpoint under run "b" ends at the
    same weights as run "a" after epoch 3. Dropout is off: only rank 0's RNG is saved."""
    monkeypatch.setattr(nn, "Dropout", lambda p: nn.Identity())

    def ddp(run: str, epochs: int) -> pl.Trainer:
        return pl.Trainer(
            max_epochs=epochs,
            plugins=[CkptflowIO(str(tmp_path / "store"), run)],
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / run), save_top_k=-1)],
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
        )

    pl.seed_everything(0)
    first = Tiny()
    ddp("a", 3).fit(first, data())
    half = STEPS_PER_EPOCH // 2  # two ranks share each epoch
    assert sorted(os.listdir(tmp_path / "a")) == [f"epoch={e}-step={(e + 1) * half}.ckpt" for e in range(3)]

    pl.seed_everything(0)
    second = Tiny()
    ddp("b", 3).fit(second, data(), ckpt_path=str(tmp_path / "a" / f"epoch=1-step={2 * half}.ckpt"))
    for name, tensor in second.state_dict().items():
        assert torch.equal(tensor, first.state_dict()[name]), name
    with Checkpointer(str(tmp_path / "store"), "b") as ck:
        assert [i.step for i in ck.list()] == [3 * half]


class SignalledAt(pl.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            signal.raise_signal(signal.SIGUSR1)


def test_a_preemption_signal_saves_that_step_and_stops_then_resume_starts_there(tmp_path):
    from ckptflow.integrations.lightning_preemption import CkptflowPreemption

    pl.seed_everything(0)
    model, preempt = Tiny(), CkptflowPreemption(tmp_path / "pre", signals=(signal.SIGUSR1,))
    run = trainer(tmp_path / "store", "pre", tmp_path / "pre", checkpointing=False)
    run.callbacks.extend([preempt, SignalledAt(5)])
    run.fit(model, data())
    assert preempt.saved_step == 6 and run.global_step == 6 and len(model.losses) == 6  # stopped after the step
    assert signal.getsignal(signal.SIGUSR1) is not preempt._on_signal  # put back at teardown
    pl.seed_everything(123)
    again = Tiny()
    trainer(tmp_path / "store", "pre", tmp_path / "pre", checkpointing=False).fit(
        again, data(), ckpt_path=preempt.saved_path
    )
    assert len(again.losses) == EPOCHS * STEPS_PER_EPOCH - 6  # resumed exactly at the signalled step
