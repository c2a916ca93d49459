"""Rank records whose seal is valid but whose content no save writes (a buggy or hostile
writer): damage, found alike by verify, restore and load when the record is parsed,
before any tensor of the live state is written and before any size it claims is
allocated."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, NoValidCheckpointError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format.sealed import seal
from ckptflow.store import open_store

RUN = "r"


@pytest.fixture
def root(tmp_path):
    """Step 1 and step 2 (other weights) of a model and a plain value."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"model": model, "x": 1})
        with torch.no_grad():
            model.weight.add_(1)
        ck.save(2, {"model": model, "x": 2})
    return root


def reseal_rank_record(root: str, step: int, mutate) -> None:
    """Apply ``mutate`` to the JSON of rank 0's record at ``step`` and seal it again."""
    manifest = catalog.read_manifest(open_store(root), RUN, step)
    path = Path(root, *manifest.rank_key(0).split("/"))
    record = json.loads(path.read_bytes())
    record.pop("checksum")
    mutate(record)
    path.write_bytes(seal(record))


def assert_damage_everywhere(root: str, why: str) -> None:
    """verify finds it, restore falls back to step 1 leaving nothing of step 2, load too."""
    with Checkpointer(root, RUN) as ck:
        report = ck.verify(2)
        assert report.damaged and why in "; ".join(report.problems), report.problems
        live = {"model": torch.nn.Linear(4, 4), "x": 0}
        result = ck.restore(live)
        assert result.step == 1 and [s for s, _ in result.skipped] == [2] and why in result.skipped[0][1]
        assert live["x"] == 1
        result, saved = ck.load()
        assert result.step == 1 and saved["x"] == 1


def rename_weight(record: dict) -> None:
    text = json.dumps(record["state"]).replace('"model.weight"', '"model.wei"')
    record["state"] = json.loads(text)


@pytest.mark.parametrize(
    "mutate, why",
    [
        pytest.param(rename_weight, "'model.wei', which its manifest does not index", id="unindexed-tensor"),
        pytest.param(lambda r: r.update(state=None), "has a state that is not a JSON object", id="state-null"),
        pytest.param(lambda r: r.update(state=[1, 2]), "has a state that is not a JSON object", id="state-list"),
        pytest.param(lambda r: r["state"].update(x={"__tuple__": 5}), "does not decode", id="value-undecodable"),
    ],
)
def test_a_rank_record_state_no_save_writes_is_damage_before_anything_is_written(root, mutate, why):
    reseal_rank_record(root, 2, mutate)
    assert_damage_everywhere(root, why)


def test_a_numpy_value_of_a_dtype_no_save_writes_is_refused_unallocated(root):
    """``np.void(n)`` allocates n zero bytes: 30 bytes of record would cost 2 GiB each."""
    reseal_rank_record(root, 2, lambda r: r["state"].update(x={"__numpy__": ["|V8", 1 << 26]}))
    assert_damage_everywhere(root, "which no save writes")


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda rng: rng.update(python=[1, 2]), id="python-short"),
        pytest.param(lambda rng: rng.update(numpy=["MT19937", [1], 0, 0, 0.0]), id="numpy-short-key"),
        pytest.param(lambda rng: rng.pop("numpy"), id="numpy-missing"),
        pytest.param(lambda rng: rng.update(torch="not base64!"), id="torch-not-base64"),
        pytest.param(lambda rng: rng.update(cuda="AAAA"), id="cuda-not-a-list"),
        pytest.param(lambda rng: rng.update(torch="AAAA"), id="torch-wrong-size"),
        pytest.param(lambda rng: rng.update(torch=base64.b64encode(bytes(5056)).decode()), id="torch-invalid"),
    ],
)
def test_an_rng_state_restore_could_not_apply_is_damage_and_leaves_the_state(root, request, mutate):
    """Before, the tensors were read into place and then restoring the RNG raised a bare
    ValueError or RuntimeError: the state overwritten, and no fallback. What torch's own
    generator refuses only torch can tell: verify, which does not import it, passes that."""
    reseal_rank_record(root, 2, lambda r: mutate(r["rng"]))
    by_torch = request.node.callspec.id in ("torch-wrong-size", "torch-invalid")
    with Checkpointer(root, RUN) as ck:
        assert ck.verify(2).damaged is not by_torch
        live = {"model": torch.nn.Linear(4, 4), "x": 0}
        kept = live["model"].weight.detach().clone()
        with pytest.raises(NoValidCheckpointError, match="rng"):
            ck.restore(live, step=2)
        assert torch.equal(live["model"].weight, kept) and live["x"] == 0
        result = ck.restore(live)
        assert result.step == 1 and [s for s, _ in result.skipped] == [2] and "rng" in result.skipped[0][1]
        assert ck.load()[0].step == 1
