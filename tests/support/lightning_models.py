"""The tiny Lightning models and data the Lightning tests train: dropout and a shuffled
loader, so a resume that loses the RNG state or a callback's state shows in the losses."""

from __future__ import annotations

import logging
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, STEPS_PER_EPOCH = 4, 8


@pytest.fixture(autouse=True)
def quiet():
    """Lightning's info logs and warnings out of the test output (import it into a test module)."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, crash_at: int | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["crash_at"])
        self.crash_at = crash_at
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise RuntimeError("killed")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, 3, 0.5)]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * 8, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


class Validated(Tiny):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))
