"""Any training job's state: a model's own state_dict, partial and non-strict restores,
structural mismatches that raise instead of falling back, values that come back as they
went in, per-rank values."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptflow import Checkpointer, StateMismatchError, UnsupportedStateError, open_store, per_rank
from ckptflow.chunks.io import ChunkStore
from ckptflow.dcp.failures import own_errors
from ckptflow.dcp.save_spec import SaveSpec
from ckptflow.dcp.writer import CheckpointWriter
from support.faulty_store import FaultyStore
from support.states import tiny_state, tiny_train


def test_a_models_own_state_dict_is_a_state(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, model.state_dict())
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        target = fresh.state_dict()  # dotted top-level keys: "0.weight", "1.running_mean", ...
        assert ck.restore(target).step == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_flattened_name_collisions_are_refused(tmp_path):
    with Checkpointer(str(tmp_path), "r") as ck, pytest.raises(UnsupportedStateError, match="'a.b'"):
        ck.save(1, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}})


def test_a_subset_of_the_entries_restores_and_the_rest_is_not_read(tmp_path):
    state = tiny_state(seed=0)
    tiny_train(state, 2)
    store = FaultyStore(open_store(str(tmp_path)), count_reads=True)
    with Checkpointer(store, "r") as ck:
        ck.save(1, state)
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        store.reset_counts()
        assert ck.restore({"model": fresh}).step == 1
    read = {key for _, op, key in store.log if op == "get" and key.startswith("chunks/")}
    model_bytes = sum(t.numel() * t.element_size() for t in fresh.state_dict().values())
    assert read and len(read) <= 4  # the model's chunks (8 MiB chunks: one per tensor), not the optimizer's
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), state["model"].parameters()))
    assert model_bytes < sum(p.numel() * 4 * 3 for p in state["model"].parameters())  # the optimizer holds more


def test_strict_false_loads_what_matches_and_says_what_did_not(tmp_path):
    saved = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, {"model": saved})
        grown = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
        head = grown[2].weight.detach().clone()
        with pytest.raises(StateMismatchError, match=r"keys missing from the checkpoint: 'model.2.bias', 'model.2"):
            ck.restore({"model": grown})
        result = ck.restore({"model": grown}, strict=False)
    assert result.missing_keys == ["model.2.bias", "model.2.weight"] and result.unexpected_keys == []
    assert torch.equal(grown[0].weight, saved[0].weight) and torch.equal(grown[2].weight, head)


def test_a_state_the_newest_checkpoint_does_not_match_raises_instead_of_falling_back(tmp_path):
    state = tiny_state(seed=0)
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, state)  # the full state
        ck.save(2, {"model": state["model"]})  # then model only
        live = tiny_state(seed=3)
        weights = [p.detach().clone() for p in live["model"].parameters()]
        with pytest.raises(StateMismatchError, match=r"run 'r' step 2.*entries of the state the checkpoint lacks"):
            ck.restore(live)  # not a silent restore of step 1
    assert all(torch.equal(a, b) for a, b in zip(live["model"].parameters(), weights))


def test_a_missing_plain_value_is_found_before_any_tensor_is_written(tmp_path):
    state = tiny_state(seed=0)
    del state["extra"]
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, state)
        live = tiny_state(seed=9)
        live["epoch"] = 4
        weights = [p.detach().clone() for p in live["model"].parameters()]
        with pytest.raises(StateMismatchError, match="'epoch'"):
            ck.restore(live)
    assert all(torch.equal(a, b) for a, b in zip(live["model"].parameters(), weights))


def test_values_come_back_as_they_went_in(tmp_path):
    z = torch.complex(torch.arange(4.0), torch.ones(4))
    state = {
        "config": {"zeta": 1, "alpha": 2, "mid": {"b": 1, "a": 2}},
        "ordered": OrderedDict([("z", 1), ("a", 2)]),
        "scalars": {"f32": np.float32(0.1), "i64": np.int64(2**40), "flag": np.bool_(True), "f64": np.float64(1e-300)},
        "by_int": {3: "three", 1: "one"},
        "pair": (1, "two"),
        "z": z.conj(),  # a conjugate view: saved resolved
    }
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, state)
        live = {
            "config": {},
            "ordered": None,
            "scalars": {},
            "by_int": {},
            "pair": None,
            "z": torch.zeros(4, dtype=z.dtype),
        }
        ck.restore(live)
    assert list(live["config"]) == ["zeta", "alpha", "mid"] and list(live["config"]["mid"]) == ["b", "a"]
    assert type(live["ordered"]) is OrderedDict and list(live["ordered"]) == ["z", "a"]
    assert type(live["scalars"]["f32"]) is np.float32 and live["scalars"]["f32"] == np.float32(0.1)
    assert type(live["scalars"]["i64"]) is np.int64 and live["scalars"]["i64"] == 2**40
    assert type(live["scalars"]["flag"]) is np.bool_ and live["scalars"]["f64"] == 1e-300
    assert live["by_int"] == {3: "three", 1: "one"} and live["pair"] == (1, "two")
    assert torch.equal(live["z"], z.conj().resolve_conj())


def test_a_non_tensor_in_a_raw_dcp_save_is_refused_with_what_to_do(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    spec = SaveSpec(run="r", step=1, kind="full", base_step=None, skeleton={}, rng=None, metadata={},
                    world_size=1, save_id="a" * 32)  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        writer = CheckpointWriter(ChunkStore(open_store(str(tmp_path))), spec, pool)
        with pytest.raises(UnsupportedStateError) as err, own_errors():
            dcp.save({"w": torch.ones(2), "epoch": {"n": 3}}, storage_writer=writer, no_dist=True)
    assert "would pickle" in str(err.value) and "Checkpointer" in str(err.value)


def test_per_rank_values_keep_one_copy_per_rank(tmp_path):
    stats = torch.arange(4.0)
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, {"bn": per_rank({"running_mean": stats}), "w": torch.ones(2)})
        live = {"bn": per_rank({"running_mean": torch.zeros(4)}), "w": torch.zeros(2)}
        ck.restore(live)
        manifest = ck.list()[0]
    assert torch.equal(live["bn"].value["running_mean"], stats)
    from ckptflow.catalog import checkpoints as catalog

    names = set(catalog.read_manifest(open_store(str(tmp_path)), "r", manifest.step).dcp.tensors)
    assert names == {"bn.running_mean@rank0", "w"}


def test_load_gives_back_a_new_state_as_it_was_saved(tmp_path):
    state = tiny_state(seed=0)
    tiny_train(state, 2)
    with Checkpointer(str(tmp_path), "r") as ck:
        ck.save(3, {**state, "epoch": 5})
        result, loaded = ck.load()
    assert result.step == 3 and loaded["epoch"] == 5 and loaded["extra"] == 2
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].state_dict().items())
    fresh = tiny_state(seed=1)
    fresh["model"].load_state_dict(loaded["model"])
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def test_a_ctrl_c_while_chunks_are_written_is_a_keyboard_interrupt_not_a_dcp_failure(tmp_path, monkeypatch):
    """DCP catches what its write step raises, Ctrl-C included, and wraps it: the CLI then
    printed a traceback of a CheckpointException instead of saying it was interrupted."""

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ChunkStore, "_store", interrupted)
    with pytest.raises(KeyboardInterrupt), Checkpointer(str(tmp_path), "r") as ck:
        ck.save(1, {"w": torch.ones(4)})
    assert not ck.list()


def test_the_causes_of_other_ranks_noted_on_the_error_raised_are_told_with_it():
    """``own_errors`` raises the first rank's error and notes the others' causes on it; the exit's
    report of a lost async save (``describe_causes``) told the first cause alone."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptflow.dcp.failures import describe_causes, unwrap_failures
    from ckptflow.errors import StoreFullError, StoreUnavailableError

    with pytest.raises(StoreUnavailableError) as err, own_errors():
        raise CheckpointException("save", {0: StoreUnavailableError("store down"), 1: StoreFullError("disk full")})
    told = describe_causes(unwrap_failures(err.value))
    assert "store down" in told and "other ranks failed too: disk full" in told
