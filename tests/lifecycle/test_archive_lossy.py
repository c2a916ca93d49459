"""Lossy archival (``lifecycle.archive`` with a lossy ``ArchiveCodec``): what the copy's
record says it lost, and the metric change its re-evaluation reports."""

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.store import open_store

BF16 = ArchiveCodec.parse("weights=bf16,optimizer=exact")


def _hot(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8))
    hot = open_store(str(tmp_path / "hot"))
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": model})
    return hot


def _weight_sum(tensors, info):
    return {"val_loss": 1.0 + 1e-6 * float(sum(t.double().sum() for t in tensors.values()))}


def test_the_metric_change_compares_one_evaluators_scores(tmp_path):
    """The exact checkpoint was evaluated with an older evaluator (another validation set,
    another scale): its figure is no baseline for the run's evaluator now, which scores
    the exact checkpoint itself."""
    hot, arc = _hot(tmp_path), open_store(str(tmp_path / "arc"))
    lifecycle.evaluate(hot, hot, "r", 1, lambda tensors, info: {"val_loss": 10.0}, evaluator_name="pkg:old_set")
    report = lifecycle.archive(hot, arc, "r", 1, codec=BF16, evaluator=_weight_sum, evaluator_name="pkg:new_set")
    evaluation = report.evaluation
    assert evaluation["evaluator"] == "pkg:new_set"
    assert evaluation["metrics_exact"]["val_loss"] == pytest.approx(1.0, abs=1e-3)
    assert abs(evaluation["metric_change"]["val_loss"]) < 1e-6


def test_the_metric_change_reuses_the_same_evaluators_exact_score(tmp_path):
    hot, arc = _hot(tmp_path), open_store(str(tmp_path / "arc"))
    recorded = lifecycle.evaluate(hot, hot, "r", 1, _weight_sum, evaluator_name="pkg:set")
    calls = []

    def counting(tensors, info):
        calls.append(info["manifest_digest"])
        return _weight_sum(tensors, info)

    report = lifecycle.archive(hot, arc, "r", 1, codec=BF16, evaluator=counting, evaluator_name="pkg:set")
    assert report.evaluation["metrics_exact"] == recorded["metrics"]
    assert calls == [report.archive_digest]  # only the lossy copy was scored again


def test_a_lossy_checkpoint_is_archived_as_it_is_with_what_it_lost(tmp_path):
    """A checkpoint that is a lossy copy already (an import of a lossy export): rounded
    again for an optimizer-only codec, its record said the weights were exact."""
    hot, lossy_hot, arc = _hot(tmp_path), open_store(str(tmp_path / "lossy")), open_store(str(tmp_path / "arc"))
    assert lifecycle.archive(hot, lossy_hot, "r", 1, codec=BF16).ok
    held = catalog.read_manifest(lossy_hot, "r", 1)
    report = lifecycle.archive(lossy_hot, arc, "r", 1, codec=ArchiveCodec.parse("weights=exact,optimizer=int8"))
    assert report.ok, report.problems
    copy = catalog.read_manifest(arc, "r", 1)
    assert copy.digest == held.digest == report.archive_digest and copy.lossy["weights"] == "bf16"
    assert report.lossy == held.lossy


def test_an_exact_archive_copy_of_a_lossy_checkpoint_lets_its_hot_copy_expire(tmp_path):
    """A lossy checkpoint (here a lossy archive copy, as an import of its export would be)
    archived exactly: the archive holds that very commit, whose record names the commit
    it was rounded from. Retention's check that the copy matches said "a lossy copy of
    another commit" and kept the hot copy for ever."""
    hot, lossy_hot, arc = _hot(tmp_path), open_store(str(tmp_path / "lossy")), open_store(str(tmp_path / "arc"))
    assert lifecycle.archive(hot, lossy_hot, "r", 1, codec=BF16).ok
    assert lifecycle.archive(lossy_hot, arc, "r", 1).ok
    assert catalog.read_manifest(arc, "r", 1).digest == catalog.read_manifest(lossy_hot, "r", 1).digest
    assert lifecycle.copy_matches(lossy_hot, arc, "r", 1) is None
