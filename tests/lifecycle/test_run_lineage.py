"""A run declares its training config and datasets once: every checkpoint records them,
promotion carries them into the model version and its card, and a resume that declares
something else is warned, naming each difference."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, Dataset, RunLineage, UnsupportedStateError
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.format.lineage import LineageMismatchWarning
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.store import open_store

TRAIN = Dataset("s3://corpus/train", version="v3")
EVAL = Dataset("file:///data/eval.jsonl", digest="sha256:" + "ab" * 32)
LINEAGE = RunLineage(config={"lr": 0.1, "arch": "tiny", "layers": [8, 4]}, datasets=[TRAIN, EVAL])


def saved(tmp_path):
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    with Checkpointer(root, "r", lineage=LINEAGE) as ck:
        for step in (1, 2):
            ck.save(step, {"model": nn.Linear(4, 4)}, metadata={"val_loss": 1.0 / step})
    return root, open_store(root)


def test_every_checkpoint_records_the_declared_config_and_data(tmp_path):
    root, store = saved(tmp_path)
    for step in (1, 2):
        metadata = read_manifest(store, "r", step).metadata
        assert metadata["config"] == {"lr": 0.1, "arch": "tiny", "layers": [8, 4]}
        assert metadata["data"] == [
            {"uri": "s3://corpus/train", "version": "v3"},
            {"uri": "file:///data/eval.jsonl", "digest": "sha256:" + "ab" * 32},
        ]
        assert metadata["val_loss"] == 1.0 / step  # the save's own metadata is kept


def test_promotion_copies_the_lineage_into_the_model_version_and_card(tmp_path):
    root, store = saved(tmp_path)
    registry = Registry(store)
    version = promote(store, registry, PromotionRequest("m", ("r", 2), stage="stable")).registered
    assert version.lineage["training_config"]["lr"] == 0.1 and version.lineage["training_config"]["arch"] == "tiny"
    assert version.lineage["data"][0] == {"uri": "s3://corpus/train", "version": "v3"}
    assert registry.get("m", version.version).lineage == version.lineage  # as stored, not only as returned
    registry.download(version, tmp_path / "model")
    card = (tmp_path / "model" / "README.md").read_text()
    data = card.split("## Data", 1)[1]
    assert '"uri": "s3://corpus/train"' in data and '"version": "v3"' in data and "sha256:abab" in data
    assert '"lr": 0.1' in card.split("## Training config", 1)[1]


def test_a_resume_declaring_other_data_or_config_warns_naming_the_difference(tmp_path):
    root, _ = saved(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LineageMismatchWarning)  # the same lineage: no warning
        with Checkpointer(root, "r", lineage=LINEAGE) as ck:
            ck.restore({"model": nn.Linear(4, 4)})
    changed = RunLineage(
        config={"lr": 0.2, "arch": "tiny", "layers": [8, 4]}, datasets=[Dataset(TRAIN.uri, version="v4")]
    )
    with Checkpointer(root, "r", lineage=changed) as ck:
        with pytest.warns(LineageMismatchWarning) as caught:
            ck.restore({"model": nn.Linear(4, 4)})
    [message] = [str(w.message) for w in caught if w.category is LineageMismatchWarning]
    assert "resumed from step 2" in message
    assert "config 'lr': checkpoint 0.1, now 0.2" in message
    assert "dataset s3://corpus/train: checkpoint version v3, now version v4" in message
    assert "dataset file:///data/eval.jsonl: in the checkpoint, not declared now" in message
    assert "'arch'" not in message  # only what differs


def test_bad_lineage_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="version or a content digest"):
        Dataset("s3://corpus/train")
    with pytest.raises(UnsupportedStateError, match="JSON"):
        RunLineage(config={"lr": object()})
    with Checkpointer(str(tmp_path), "r", lineage=LINEAGE) as ck:
        with pytest.raises(UnsupportedStateError, match="declared lineage"):
            ck.save(1, {"model": nn.Linear(2, 2)}, metadata={"config": {"lr": 9}})
        assert ck.list() == []
