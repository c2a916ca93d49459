"""Export of a checkpoint whose validation verdict is "failed" is refused without an opt-in.

The verdict is the lifecycle record of exactly that commit (its manifest digest): the
refusal says when it was recorded and what failed, even when the damage lies outside the
exported weights, and even after the bytes were repaired (re-validate to clear it).
With ``allow_failed`` / ``--allow-failed`` the export is written, and says so.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.checkpoints import read_manifest
from ckptflow.errors import CkptflowError
from ckptflow.interop.export import export_dcp, export_safetensors
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import chunk_path, flip_byte, tensor_chunk

RUN = "v"


@pytest.fixture
def failed(tmp_path):
    """Steps 1 and 2; step 2's ``extra`` tensor (not the model) damaged and validated: failed."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with Checkpointer(root, RUN) as ck:
        for step in (1, 2):
            ck.save(step, {"model": model, "extra": torch.full((64,), float(step))})
    damaged = chunk_path(root, tensor_chunk(root, RUN, 2, "extra"))
    flip_byte(damaged)
    verdict = lifecycle.validate(open_store(root), RUN, 2)
    assert not verdict["ok"]
    return root, damaged, verdict


def test_export_of_a_step_that_failed_validation_is_refused_saying_why(failed, tmp_path):
    root, _, verdict = failed
    out = tmp_path / "m.safetensors"
    with pytest.raises(CkptflowError) as refused:
        export_safetensors(root, RUN, out, step=2)  # the model's own chunks are fine
    message = str(refused.value)
    when = datetime.fromtimestamp(verdict["recorded_at"], timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert "failed validation" in message and when in message and "does not match" in message
    assert "--allow-failed" in message and "allow_failed=True" in message
    assert not out.exists()
    result = export_safetensors(root, RUN, out, step=2, allow_failed=True)
    assert result.failed_validation is not None and result.failed_validation["recorded_at"] == verdict["recorded_at"]
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["ckptflow.failed_validation"])["problems"] == verdict["problems"]


def test_a_repaired_step_keeps_its_verdict_until_validated_again(failed, tmp_path):
    root, damaged, _ = failed
    flip_byte(damaged)  # the same byte flipped back: the bytes verify again
    for export, out in ((export_safetensors, tmp_path / "m.safetensors"), (export_dcp, tmp_path / "dcp")):
        with pytest.raises(CkptflowError, match="step 2 failed validation"):
            export(root, RUN, out)  # the newest that verifies is step 2, and its verdict says failed
        assert not out.exists()
    assert export_dcp(root, RUN, tmp_path / "dcp", allow_failed=True).step == 2
    assert lifecycle.validate(open_store(root), RUN, 2)["ok"]  # a new verdict for the same commit
    assert export_safetensors(root, RUN, tmp_path / "m.safetensors").step == 2


def test_the_verdict_of_another_commit_of_the_step_does_not_count(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(3, {"model": nn.Linear(2, 2)})
    store = open_store(root)
    other = lifecycle.Subject(RUN, 3, "0" * 64)  # an earlier commit of step 3, since replaced
    lifecycle.write_record(store, other, "validation", {"ok": False, "problems": ["old damage"]})
    assert read_manifest(store, RUN, 3).digest != other.digest
    assert export_safetensors(root, RUN, tmp_path / "m.safetensors", step=3).step == 3


def test_cli_export_of_a_step_that_failed_validation(failed, tmp_path, capsys):
    root, _, _ = failed
    out = tmp_path / "m.safetensors"
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--step", "2", "--out", out)
    assert code == 2 and "failed validation" in err and "--allow-failed" in err and not out.exists()
    code, stdout, err = run_cli(capsys, "export", root, "--run", RUN, "--step", "2", "--out", out, "--allow-failed")
    assert code == 0, err
    assert "exported run v step 2" in stdout and "failed validation" in err
