"""A tiny model with tied weights, saved as checkpoints of run "r", for the registry tests."""

from __future__ import annotations

import torch
from torch import nn

from ckptflow import Checkpointer
from ckptflow.interop.export import model_metadata


class Tiny(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.head = nn.Linear(width, 32, bias=False)
        self.head.weight = self.embed.weight


def checkpoints(tmp_path, steps=(1, 2), width: int = 16) -> tuple[str, dict]:
    root = str(tmp_path / "hot")
    models = {}
    with Checkpointer(root, "r", chunk_bytes=1 << 20) as ck:
        for step in steps:
            torch.manual_seed(step)
            models[step] = Tiny(width)
            ck.save(step, {"model": models[step]}, metadata={**model_metadata(models[step]), "val_loss": 1.0 / step})
    return root, models
