"""Evaluation is of one commit: the record keyed by a manifest digest holds that commit's scores."""

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import CkptflowError
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.faulty_store import FaultyStore


def _model(value: float) -> nn.Module:
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_a_step_committed_again_while_it_is_evaluated_records_no_score(tmp_path):
    """Between evaluate's read of the manifest and the read of the tensors, the step is
    committed again (its first commit rejected, the step saved anew): the second
    commit's weights were scored and recorded under the first commit's digest."""
    hot = open_store(str(tmp_path / "hot"))
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": _model(1.0)})
    first = catalog.read_manifest(hot, "r", 1)
    reads = []

    def commit_again_on_second_read(op, key):
        if key == fmt.manifest_key("r", 1) and op.startswith("get"):
            reads.append(op)
            if len(reads) == 2:
                hot.delete(key)
                with Checkpointer(hot, "r") as ck:
                    ck.save(1, {"model": _model(5.0)})
        return False

    store = FaultyStore(hot, count_reads=True)
    store.fail_if = commit_again_on_second_read
    with pytest.raises(CkptflowError, match="committed again while it was being evaluated"):
        lifecycle.evaluate(store, hot, "r", 1, lambda t, info: {"w": float(t["weight"].sum())}, evaluator_name="w")
    assert lifecycle.read_record(hot, lifecycle.Subject.of(first), "evaluation") is None
    assert lifecycle.evaluate(hot, hot, "r", 1, lambda t, info: {"w": float(t["weight"].sum())})["metrics"] == {
        "w": 20.0
    }
