"""Lightning's own loading paths over ckptflow pointers: ``load_from_checkpoint`` (the
function, and the mixin that makes ``Model.load_from_checkpoint(pointer)`` work), and a
trainer's ``validate`` / ``test`` with ``ckpt_path`` a pointer or ``"best"``."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptflow import CkptflowError
from ckptflow.integrations.lightning import CkptflowCheckpoints, CkptflowIO, is_pointer, load_from_checkpoint
from support.lightning_models import quiet  # noqa: F401  (an autouse fixture)


class Scored(pl.LightningModule):
    """Validation loss that moves epoch to epoch, so "best" is one particular epoch."""

    def __init__(self, lr: float = 0.2, width: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in self.state_dict().items()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Loadable(CkptflowCheckpoints, Scored):
    pass


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def trainer(tmp_path, *, plugin: bool = True, epochs: int = 4) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        plugins=[CkptflowIO(str(tmp_path / "store"), "scored")] if plugin else [],
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="val_loss", save_top_k=-1, save_last=True)],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def trained(tmp_path) -> tuple[pl.Trainer, dict[str, dict[str, torch.Tensor]]]:
    """Fit with a checkpoint per epoch; each pointer's weights as they were at its save."""
    pl.seed_everything(0)
    t = trainer(tmp_path)
    weights: dict[str, dict[str, torch.Tensor]] = {}

    class Record(pl.Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint):
            weights[str(trainer.global_step)] = {k: v.clone() for k, v in module.state_dict().items()}

    t.callbacks.append(Record())
    t.fit(Scored(lr=0.2, width=8), loader(), loader())
    return t, weights


def step_of(path: str) -> str:
    return path.rsplit("step=", 1)[1].split(".")[0].split("-")[0]


def test_load_from_checkpoint_reads_a_pointer(tmp_path):
    t, weights = trained(tmp_path)
    best = t.checkpoint_callback.best_model_path
    assert is_pointer(best)
    with pytest.raises(Exception, match="load"):  # Lightning's loader alone: torch.load on a JSON file
        Scored.load_from_checkpoint(best)
    for model in (load_from_checkpoint(Scored, best), Loadable.load_from_checkpoint(best)):
        assert model.hparams.lr == 0.2 and model.hparams.width == 8
        for key, value in weights[step_of(best)].items():
            assert torch.equal(model.state_dict()[key], value), key
    wider = load_from_checkpoint(Scored, best, strict=False, width=8, lr=0.5)  # kwargs override hparams
    assert wider.hparams.lr == 0.5


def test_trainer_validate_and_test_with_ckpt_path_best_and_a_pointer(tmp_path):
    t, weights = trained(tmp_path)
    best = t.checkpoint_callback.best_model_path
    model = Scored(lr=0.2, width=8)
    t.test(model, loader(), ckpt_path="best")
    assert all(torch.equal(model.seen[-1][k], v) for k, v in weights[step_of(best)].items())
    first = sorted(p for p in (tmp_path / "ckpts").iterdir() if "step=" in p.name)[0]
    assert t.validate(model, loader(), ckpt_path=str(first))[0]["val_loss"] > 0
    t.test(model, loader(), ckpt_path=str(first))
    assert all(torch.equal(model.seen[-1][k], v) for k, v in weights[step_of(str(first))].items())


def test_anything_but_a_pointer_is_refused_saying_what_to_do(tmp_path):
    pickled = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, pickled)
    with pytest.raises(CkptflowError, match="ckptflow import"):
        load_from_checkpoint(Scored, pickled)
    assert not is_pointer(pickled)
