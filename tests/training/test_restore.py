"""Checkpointer, restore side: RNG streams after restore, restoring an explicit step
(never falls back) vs the newest valid one, restoring into mismatched state, and the
UnsupportedStateError for state values and keys that cannot be checkpointed.

Save-side behaviour is in training/test_checkpointer.py; shared helpers are in tests/support/ and
conftest.py (``make_ck``).
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

from ckptflow import NoValidCheckpointError, PartialRestoreError, StateMismatchError, UnsupportedStateError
from ckptflow.catalog import checkpoints as catalog
from ckptflow.catalog import recovery_log
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.corrupt import manifest_path
from support.states import assert_state_equals, snapshot

# ---- RNG ----------------------------------------------------------------------------------


def _draws():
    return torch.rand(5), random.random(), np.random.rand(3)


def test_rng_streams_continue_exactly_after_restore(make_ck, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory()
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    tiny_train_step(state, 2)
    random.random()
    np.random.rand(2)

    ck = make_ck()
    ck.save(2, state)
    # the uninterrupted run's next draws
    t_exp, py_exp, np_exp = _draws()

    # the "crashed" process goes on and its RNG state diverges
    tiny_train_step(state, 3)
    random.seed(999)
    np.random.seed(999)
    t_other, py_other, np_other = _draws()
    assert not torch.equal(t_other, t_exp) and py_other != py_exp  # sanity: the streams did move

    result = ck.restore(state)
    assert result.step == 2 and result.rng_restored
    t_got, py_got, np_got = _draws()
    assert torch.equal(t_got, t_exp)
    assert py_got == py_exp
    np.testing.assert_array_equal(np_got, np_exp)


CUDA_DEVICES = 2  # the saving process's, as torch.cuda answers it below


def _save_as_on_cuda(ck, state, monkeypatch):
    """Save as a process with two CUDA devices does (the RNG record holds each one's generator
    state); then the next torch draws, and what the CUDA generators held."""
    saved = [torch.Generator().manual_seed(device).get_state() for device in range(CUDA_DEVICES)]
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        cuda.setattr(torch.cuda, "is_initialized", lambda: True)
        cuda.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
        ck.save(1, state)
    return torch.rand(3), saved


@pytest.mark.parametrize("devices", [0, 1])  # restored without CUDA; on another number of devices
def test_cuda_rng_states_it_cannot_apply_are_reported_not_restored(
    make_ck, tiny_state_factory, monkeypatch, caplog, devices
):
    """rng_restored was True while the CUDA states were dropped in silence: GPU random streams
    (dropout) went on from wherever they were. The CPU ones are restored, the CUDA ones are
    named as skipped, rng_restored is False (Warmup(seed=) then reseeds), and a warning says why."""
    state = tiny_state_factory()
    ck = make_ck()
    next_draws, _ = _save_as_on_cuda(ck, state, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("CUDA states set on other devices"))
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, "ckptflow"):
        result = ck.restore(state)
    assert torch.equal(torch.rand(3), next_draws)  # the CPU generator's stream continues
    assert result.rng_restored is False and result.rng_skipped == ["cuda"]
    [warning] = [r.getMessage() for r in caplog.records if "CUDA" in r.getMessage()]
    assert warning.startswith("run 'r' step 1 (rank 0): restored the python, numpy and torch RNG states, not CUDA's")
    assert f"{CUDA_DEVICES} CUDA devices saved, {devices} here" in warning and "Warmup(seed=" in warning


def test_cuda_rng_states_are_restored_on_as_many_devices(make_ck, tiny_state_factory, monkeypatch):
    state = tiny_state_factory()
    ck = make_ck()
    _, saved = _save_as_on_cuda(ck, state, monkeypatch)
    applied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: CUDA_DEVICES)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", applied.extend)
    result = ck.restore(state)
    assert result.rng_restored is True and result.rng_skipped == []
    assert [s.tolist() for s in applied] == [s.tolist() for s in saved]


def test_restore_rng_false_leaves_rng_alone(make_ck, tiny_state_factory):
    state = tiny_state_factory()
    torch.manual_seed(1)
    make_ck().save(1, state)
    expected_next = torch.rand(3)
    torch.manual_seed(2)
    expected_other = torch.get_rng_state()
    result = make_ck(restore_rng=False).restore(state)
    assert result.rng_restored is False
    assert torch.equal(torch.get_rng_state(), expected_other)
    assert not torch.equal(torch.rand(3), expected_next)


# ---- errors -------------------------------------------------------------------------------


def test_restore_exact_step_never_falls_back(make_ck, ckpt_store_dir, tiny_state_factory, tiny_train_step):
    state = tiny_state_factory()
    ck = make_ck()
    ck.save(1, state)
    tiny_train_step(state)
    ck.save(2, state)
    m1 = catalog.read_manifest(open_store(ckpt_store_dir), "r", 1)
    m2 = catalog.read_manifest(open_store(ckpt_store_dir), "r", 2)
    only_2 = sorted(set(m2.chunks) - set(m1.chunks))
    assert only_2
    path = os.path.join(ckpt_store_dir, *fmt.chunk_key(only_2[0]).split("/"))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))

    tiny_train_step(state, 2)
    live = snapshot(state)
    with pytest.raises(NoValidCheckpointError) as err:
        ck.restore(state, step=2)
    assert [s for s, _ in err.value.skipped] == [2]
    assert only_2[0] in err.value.skipped[0][1]
    assert_state_equals(state, live)  # the live state was not touched

    with pytest.raises(NoValidCheckpointError, match="has no step 99") as err:
        ck.restore(state, step=99)  # never saved: nothing to skip as damaged
    assert err.value.skipped == []
    assert_state_equals(state, live)

    # without step=, restore falls back to step 1
    assert ck.restore(state).step == 1


def test_a_step_that_does_not_exist_is_refused_naming_the_steps_there(
    make_ck, tmp_path, tiny_state_factory, tiny_train_step, caplog
):
    """It said "cannot be restored: no manifest at …: the checkpoint was never committed" after
    a warning "skipping checkpoint r step 7": damage, and nothing on what to restore instead.
    The steps of every tier (the archive's 5 too) and what to do are named, nothing is read."""
    state = tiny_state_factory()
    tiny_train_step(state)
    archive = str(tmp_path / "archive")
    make_ck(root=archive).save(5, state)
    ck = make_ck(tiers=[archive])
    for step in (1, 2):
        ck.save(step, state)
    live = snapshot(state)
    for restore in (lambda: ck.restore(state, step=7), lambda: ck.load(step=7)):
        with caplog.at_level(logging.WARNING, "ckptflow"), pytest.raises(NoValidCheckpointError) as err:
            restore()
        assert str(err.value).startswith("run 'r' has no step 7 (steps: 1, 2, 5) in ")
        assert str(err.value).endswith("restore one of those (step=N), or leave step out for the newest whole one")
        assert err.value.skipped == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_state_equals(state, live)


def test_restore_with_no_checkpoint_raises(make_ck, tiny_state_factory):
    with pytest.raises(NoValidCheckpointError, match="no checkpoints at all"):
        make_ck().restore(tiny_state_factory())


@pytest.mark.parametrize(
    "extra, path",
    [
        ({1, 2}, "extra"),
        (object(), "extra"),
        ({"cfg": {"items": [1, 2, {3}]}}, "extra.cfg.items.2"),
        ({"fn": len}, "extra.fn"),
    ],
)
def test_unsupported_state_value_names_its_path(make_ck, ckpt_store_dir, tiny_state_factory, extra, path):
    state = tiny_state_factory()
    state["extra"] = extra
    ck = make_ck()
    with pytest.raises(UnsupportedStateError) as err:
        ck.save(1, state)
    assert repr(path) in str(err.value)
    assert ck.list() == []
    assert not os.path.exists(manifest_path(ckpt_store_dir, "r", 1))


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (lambda: torch.quantize_per_tensor(torch.ones(1000), 0.1, 0, torch.qint8), r"is quantized \(qint8\)"),
        (lambda: torch.eye(3).to_sparse(), "has layout torch.sparse_coo"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "is a nested tensor"),
    ],
    ids=["quantized", "sparse", "nested"],
)
def test_a_tensor_ckptflow_cannot_store_is_refused_before_anything_is_written(make_ck, ckpt_store_dir, tensor, why):
    """Refused up front, naming it: a quantized tensor was written, then refused at commit
    as a damaged manifest ("written by a newer ckptflow?"); sparse and nested ones raised raw."""
    with pytest.raises(UnsupportedStateError, match=f"tensor at 'extra.t' {why}, which ckptflow cannot store"):
        make_ck().save(1, {"extra": {"t": tensor()}})
    assert not [f for _, _, files in os.walk(ckpt_store_dir) for f in files]


def test_state_keys_must_be_non_empty_strings(make_ck, tiny_state_factory):
    for bad in ("", 3):
        state = tiny_state_factory()
        state[bad] = 1
        with pytest.raises(UnsupportedStateError, match="non-empty string"):
            make_ck().save(1, state)


def test_restore_into_a_state_of_another_structure_raises_and_changes_nothing(make_ck, tiny_state_factory):
    state = tiny_state_factory()
    ck = make_ck()
    ck.save(1, state)
    other = {"model": torch.nn.Linear(3, 3)}
    before = {k: v.clone() for k, v in other["model"].state_dict().items()}
    with pytest.raises(StateMismatchError, match="does not match") as err:
        ck.restore(other)
    assert "'model.weight'" in str(err.value) or "model.0.weight" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other["model"].state_dict().items())


@pytest.mark.parametrize("strict", [True, False])
def test_restore_into_tensors_of_other_shapes_raises_and_never_falls_back(make_ck, strict):
    """A model built with another size meets a newer checkpoint: that is a mismatch to report,
    not damage; restore must not pass over the healthy newer checkpoint for an older one
    whose shapes happen to fit (the read would fail inside DCP as if the bytes were bad)."""
    ck = make_ck()
    ck.save(1, {"model": torch.nn.Linear(3, 2)}, rng=False)  # the old size
    ck.save(2, {"model": torch.nn.Linear(3, 5)}, rng=False)  # the new one
    live = {"model": torch.nn.Linear(3, 2)}
    before = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with pytest.raises(
        StateMismatchError, match=r"step 2 .*shapes differ.*'model.weight' \(checkpoint \(5, 3\), state \(2, 3\)\)"
    ):
        make_ck().restore(live, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in live["model"].state_dict().items())
    assert make_ck().restore(live, step=1, strict=strict).step == 1  # the step of its size loads


def _meta_model() -> dict:
    with torch.device("meta"):
        return {"model": torch.nn.Linear(8, 8)}


def _expanded_buffer() -> dict:
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        model.bias = torch.nn.Parameter(torch.zeros(1).expand(8), requires_grad=False)
    return {"model": model}


@pytest.mark.parametrize(
    ("live", "why"),
    [(_meta_model, r"on the meta device \('model.bias', 'model.weight'\).*to_empty"),
     (_expanded_buffer, r"share memory between their elements \('model.bias'.*clone")],
    ids=["meta", "expanded"],
)  # fmt: skip
def test_live_tensors_a_restore_cannot_read_into_are_refused_before_any_read(make_ck, live, why):
    """Deferred init (meta) or an expand() is the caller's state, not damage: every sound
    checkpoint was skipped as damaged (NoValidCheckpointError, a job starts from scratch),
    or the restore failed half-way through writing."""
    with make_ck() as ck:
        for step in (1, 2):
            ck.save(step, {"model": torch.nn.Linear(8, 8)}, rng=False)
    with make_ck() as ck, pytest.raises(StateMismatchError, match=f"step 2 .*{why}.*nothing was read"):
        ck.restore(live())


class SampleCursor:
    """A data loader's position, which refuses a position saved for another dataset."""

    def __init__(self, samples: int):
        self.samples, self.position = samples, 0

    def state_dict(self) -> dict:
        return {"samples": self.samples, "position": self.position}

    def load_state_dict(self, saved: dict) -> None:
        if saved["samples"] != self.samples:
            raise ValueError(f"dataset has {self.samples} samples, the checkpoint's position is for {saved['samples']}")
        self.position = saved["position"]


def test_a_live_object_refusing_its_state_after_the_tensors_are_in_place_is_a_partial_restore(make_ck, ckpt_store_dir):
    """The tensors are read into place before the live objects get their JSON state: one
    refusing it cannot leave the caller believing nothing changed (a raw ValueError did).
    The restore is recorded as failed, and no older checkpoint is tried."""
    torch.manual_seed(0)
    with make_ck() as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4), "data": SampleCursor(100)})
        ck.save(2, {"model": torch.nn.Linear(4, 4), "data": SampleCursor(100)})
    model = torch.nn.Linear(4, 4)
    with make_ck() as ck, pytest.raises(PartialRestoreError, match=r"step 2 .* ValueError: dataset has 50 samples"):
        ck.restore({"model": model, "data": SampleCursor(50)})
    [record] = recovery_log.read_all(open_store(ckpt_store_dir), "r")
    assert record["ok"] is False and "partly overwritten" in record["error"]
    cursor = SampleCursor(100)
    with make_ck() as ck:
        assert ck.restore({"model": model, "data": cursor}).step == 2  # the same state accepted: whole again
