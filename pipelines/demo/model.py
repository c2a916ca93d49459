"""The demo's model and data: a tiny causal language model on generated sequences.

Small enough to train on CPU in seconds, real enough to exercise everything a
checkpoint holds (a module, AdamW, an LR schedule, a data-loader position).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, DIM = 32, 32, 64


class TinyLM(nn.Module):
    """A 2-layer causal transformer language model (~100k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]], mask=mask, is_causal=True))


class Batches:
    """Generated data: noisy arithmetic sequences, so the model has something to learn.

    ``Stateful``: its position is saved and restored with the checkpoint.
    """

    def __init__(self, batch_size: int = 16) -> None:
        self.batch_size, self.position = batch_size, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        start = torch.randint(0, VOCAB, (self.batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (self.batch_size, 1), generator=g)
        return (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]


def build() -> dict:
    """Fine-tuning set-up: embeddings and the first block stay frozen, as in many
    fine-tuning jobs, so incremental checkpoints only write what training changes."""
    model = TinyLM()
    for frozen in (model.embed, model.blocks.layers[0]):
        frozen.requires_grad_(False)
    model.pos.requires_grad_(False)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=400)
    return {"model": model, "optim": optim, "sched": sched, "data": Batches()}


def train_step(state: dict) -> float:
    batch = state["data"].next()
    logits = state["model"](batch[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["sched"].step()
    return loss.item()
