"""A model directory holding both ``model.safetensors`` and ``model.safetensors.index.json``
(with its shards) has two sets of weights. transformers' ``from_pretrained`` takes
``model.safetensors`` (``_get_resolved_checkpoint_files``: the index only where that file
is absent); ckptflow took the index, so the import and ``load_exported`` read other
weights than the model transformers loads from the same directory. They read the same
now: each check below is against what the real ``from_pretrained`` loads."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModel, BertConfig, BertModel

from ckptflow import Checkpointer
from ckptflow.interop.export import load_exported
from ckptflow.interop.importers import import_checkpoint
from support.tiny_bert import BERT


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: t.contiguous() for n, t in BertModel(BertConfig(**BERT)).state_dict().items()}


def both_layouts(path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``path`` with seed 1's weights in model.safetensors and seed 2's in an index and
    two shards beside it."""
    single, sharded = weights(1), weights(2)
    os.mkdir(path)
    config = BertConfig(**BERT)
    config.architectures = ["BertModel"]
    config.save_pretrained(path)
    save_file(single, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    names = sorted(sharded)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: sharded[n] for n in part}, os.path.join(path, file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in halves.items() for n in part}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return single, sharded


def test_import_and_load_exported_read_the_weights_transformers_loads(tmp_path):
    src = str(tmp_path / "model")
    single, sharded = both_layouts(src)
    name = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(single[name], sharded[name])

    loaded = AutoModel.from_pretrained(src).state_dict()
    assert torch.equal(loaded[name], single[name])  # transformers takes model.safetensors

    root = str(tmp_path / "store")
    import_checkpoint(root, "r", 1, src)
    live = {"model": {n: torch.zeros_like(t) for n, t in single.items()}}
    with Checkpointer(root, "r") as ck:
        ck.restore(live)
    differ = [n for n in single if not torch.equal(live["model"][n], loaded[n])]
    assert not differ, f"the import read other weights than transformers loads: {differ[:3]}"

    exported = load_exported(src)
    assert exported.keys() == single.keys()
    differ = [n for n in single if not torch.equal(exported[n], loaded[n])]
    assert not differ, f"load_exported read other weights than transformers loads: {differ[:3]}"


def test_an_index_alone_is_still_read(tmp_path):
    src = str(tmp_path / "model")
    _, sharded = both_layouts(src)
    os.unlink(os.path.join(src, "model.safetensors"))
    loaded = AutoModel.from_pretrained(src).state_dict()
    exported = load_exported(src)
    assert exported.keys() == sharded.keys()
    assert all(torch.equal(exported[n], loaded[n]) and torch.equal(exported[n], sharded[n]) for n in sharded)
    assert import_checkpoint(str(tmp_path / "store"), "r", 1, src).tensors == len(sharded)
