"""The demo's evaluator: validation loss of the TinyLM on held-out generated data.

Named for the demo run in the local deployment (``pipelines/definitions.py``); any other
run is scored by its own evaluator or by its trainer's recorded metrics.

Held-out batches come from generator seeds far beyond any training position, so they
are sequences the model never trained on (from the same distribution). Deterministic,
so re-evaluating a checkpoint gives the same number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipelines.demo.model import VOCAB, Batches, TinyLM

HELD_OUT_POSITION = 10_000_000
HELD_OUT_BATCHES = 4


def evaluate(state_dict: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, float]:
    model = TinyLM()
    model.load_state_dict(dict(state_dict))
    model.eval()
    data = Batches(batch_size=32)
    data.position = HELD_OUT_POSITION
    losses = []
    with torch.no_grad():
        for _ in range(HELD_OUT_BATCHES):
            batch = data.next()
            logits = model(batch[:, :-1])
            losses.append(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item())
    val_loss = sum(losses) / len(losses)
    return {"val_loss": round(val_loss, 6), "val_perplexity": round(float(torch.exp(torch.tensor(val_loss))), 4)}
