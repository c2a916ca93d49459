"""Later saves at a step ``CkptflowIO`` already committed (``ckptflow.integrations.lightning_overlay``),
with the real Lightning on CPU: a step-based ``ModelCheckpoint`` saves at the epoch's last batch,
before validation, and a monitored one saves again at that step after it."""

from __future__ import annotations

import json
import logging

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint

from ckptflow import Checkpointer, CkptflowError, lifecycle
from ckptflow.integrations import lightning
from ckptflow.integrations.lightning import CkptflowIO
from ckptflow.reports import inventory
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, only_in
from support.lightning_models import (
    EPOCHS,
    STEPS_PER_EPOCH,
    Validated,
    data,
    quiet,  # noqa: F401  (an autouse fixture)
)


class Scores(Callback):
    """The val_loss each validation gave, by step."""

    def __init__(self):
        self.by_step: dict[int, float] = {}

    def on_validation_end(self, trainer, pl_module):
        self.by_step[trainer.global_step] = float(trainer.callback_metrics["val_loss"])


def twice_a_step(root, run: str, dirpath, *, patience: int | None = 1, top_k: int = 1, also=()) -> pl.Trainer:
    """A checkpoint per epoch twice at one step (the step-based one at the epoch's last batch, before
    validation; the monitored one after it) and, with ``patience``, early stopping once ``patience``
    validations after the first did not improve."""
    stopping = [EarlyStopping("val_loss", patience=patience, min_delta=100.0)] if patience else []  # never improves
    return pl.Trainer(
        max_epochs=EPOCHS, plugins=[CkptflowIO(str(root), run)], accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, num_sanity_val_steps=0,
        callbacks=[
            ModelCheckpoint(dirpath=str(dirpath), filename="s{step}", every_n_train_steps=STEPS_PER_EPOCH),
            ModelCheckpoint(dirpath=str(dirpath), monitor="val_loss", save_last=True, save_top_k=top_k),
            *stopping, *also,
        ],
    )  # fmt: skip


def test_a_later_save_at_a_committed_step_resumes_with_its_own_callback_state(tmp_path):
    """Both saves at step 8 pointed at the first one's commit, taken before validation: resuming
    from last.ckpt restored EarlyStopping as it was before the validation at step 8, so the
    resumed run went on past step 16, where the uninterrupted run (and a torch.save resume) stops."""
    pl.seed_everything(0)
    full = Validated()
    twice_a_step(tmp_path / "store", "full", tmp_path / "full").fit(full, data(), data())
    assert full.global_step == 2 * STEPS_PER_EPOCH  # stopped early
    pl.seed_everything(0)
    with pytest.raises(RuntimeError, match="killed"):
        twice_a_step(tmp_path / "store", "part", tmp_path / "part").fit(
            Validated(crash_at=STEPS_PER_EPOCH + 2), data(), data()
        )

    pl.seed_everything(123)
    model = Validated()
    twice_a_step(tmp_path / "store", "part", tmp_path / "part").fit(model, data(), data(), ckpt_path="last")
    assert model.global_step == full.global_step
    assert torch.equal(torch.stack(model.losses), torch.stack(full.losses)[STEPS_PER_EPOCH:])
    with Checkpointer(str(tmp_path / "store"), "part") as ck:
        assert [i.step for i in ck.list()] == [8, 16]  # still one commit per step


def test_each_step_is_scored_by_its_own_validation_not_the_one_before(tmp_path):
    """The commit took the monitored callback's ``current_score`` from the first save at a step:
    before that step's validation, so step 8 had no val_loss and step 16 had step 8's, and
    retention's best-K ranked each checkpoint by another one's score."""
    pl.seed_everything(0)
    scores = Scores()
    twice_a_step(tmp_path / "store", "r", tmp_path / "r", patience=None, top_k=-1, also=[scores]).fit(
        Validated(), data(), data()
    )
    entries = {e.step: e for e in inventory.collect(open_store(str(tmp_path / "store"))) if e.run == "r"}
    assert sorted(entries) == sorted(scores.by_step) == [8, 16, 24, 32]
    assert {step: e.metrics.get("val_loss") for step, e in entries.items()} == scores.by_step
    assert len(set(scores.by_step.values())) == 4  # four different scores: none borrowed from another step
    store = open_store(str(tmp_path / "store"))
    evaluated = {step: lifecycle.evaluate(store, store, "r", step)["metrics"].get("val_loss") for step in entries}
    assert evaluated == scores.by_step  # a run with no evaluator is evaluated by its trainer's scores


def test_last_falling_back_to_a_step_resumes_with_what_its_later_save_changed(tmp_path):
    """last.ckpt names step 16, found damaged: the resume falls back to step 8, whose later save's
    changes (EarlyStopping after the validation at 8) lived only in that save's pointer. It resumed
    with EarlyStopping as before that validation and trained to step 32, where resuming from the
    step-8 pointer itself (as a torch.save run would) stops at 24."""
    root = tmp_path / "store"
    pl.seed_everything(0)
    with pytest.raises(RuntimeError, match="killed"):
        twice_a_step(root, "part", tmp_path / "part", patience=2, top_k=-1).fit(
            Validated(crash_at=2 * STEPS_PER_EPOCH + 2), data(), data()
        )
    corrupt_chunk(root, "part", 16, only_in(root, "part", 16, 8)[0])

    pl.seed_everything(123)
    by_pointer = Validated()
    twice_a_step(root, "copy", tmp_path / "copy", patience=2, top_k=-1).fit(
        by_pointer, data(), data(), ckpt_path=str(tmp_path / "part" / "epoch=0-step=8.ckpt")
    )
    assert by_pointer.global_step == 3 * STEPS_PER_EPOCH
    pl.seed_everything(123)
    by_last = Validated()
    twice_a_step(root, "part", tmp_path / "part", patience=2, top_k=-1).fit(by_last, data(), data(), ckpt_path="last")
    assert by_last.global_step == by_pointer.global_step
    assert torch.equal(torch.stack(by_last.losses), torch.stack(by_pointer.losses))


def full_save(step: int = 3) -> dict:
    return {
        "global_step": step, "epoch": 0, "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{"state": {}, "param_groups": []}], "loops": {"done": 1},
        "callbacks": {"EMA": {"t": torch.zeros(3)}, "ModelCheckpoint": {"best": 1.0}},
    }  # fmt: skip


def test_a_weights_only_save_after_a_full_one_at_its_step_loads_as_it_was_saved(tmp_path):
    """The pointer named the full commit: the weights-only file loaded with the optimizer, loops and
    callbacks of the full save (Lightning resumed training state from a weights-only checkpoint)."""
    io = CkptflowIO(str(tmp_path / "store"), "r")
    io.save_checkpoint(full_save(), tmp_path / "full.ckpt")
    weights_only = {"global_step": 3, "epoch": 0, "state_dict": {"w": torch.ones(2)}}
    io.save_checkpoint(weights_only, tmp_path / "weights.ckpt")
    io.save_checkpoint({**full_save(), "callbacks": {"EMA": {"t": torch.zeros(3)}}}, tmp_path / "fewer.ckpt")

    loaded = io.load_checkpoint(tmp_path / "weights.ckpt")
    assert sorted(loaded) == sorted(weights_only) and torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    assert list(io.load_checkpoint(tmp_path / "fewer.ckpt")["callbacks"]) == ["EMA"]
    assert sorted(io.load_checkpoint(tmp_path / "full.ckpt")) == sorted(full_save())  # its own commit, whole


@pytest.mark.parametrize("dropped", ["state_dict", [["callbacks", "a", "b"]], [["loops", "x"]], [[1]]])
def test_a_malformed_list_of_dropped_entries_is_refused_as_a_damaged_pointer(tmp_path, dropped):
    io = CkptflowIO(str(tmp_path / "store"), "r")
    io.save_checkpoint(full_save(), tmp_path / "full.ckpt")
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "w.ckpt")
    pointer = json.loads((tmp_path / "w.ckpt").read_text())
    (tmp_path / "w.ckpt").write_text(json.dumps({**pointer, "dropped": dropped}))
    with pytest.raises(CkptflowError, match=r"w\.ckpt: the entries its save left out .* the pointer is damaged"):
        io.load_checkpoint(tmp_path / "w.ckpt")


def test_changes_too_large_for_a_pointer_leave_it_naming_the_commit(tmp_path, caplog):
    io = CkptflowIO(str(tmp_path / "store"), "r")
    first = {"global_step": 3, "state_dict": {"w": torch.ones(2)}, "callbacks": {"Big": {"t": torch.zeros(1 << 19)}}}
    io.save_checkpoint(first, tmp_path / "a.ckpt")
    with caplog.at_level(logging.WARNING, logger="ckptflow"):
        io.save_checkpoint({**first, "callbacks": {"Big": {"t": torch.ones(1 << 19)}}}, tmp_path / "b.ckpt")
    assert "too large for its pointer" in caplog.text and "[\"callbacks['Big']\"]" in caplog.text
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["callbacks"]["Big"]["t"], torch.zeros(1 << 19))


def test_a_changed_callback_does_not_carry_an_unchanged_large_one_into_the_pointer(tmp_path):
    """The whole 'callbacks' entry was one fingerprint: a monitored ModelCheckpoint's new state
    re-encoded an unchanged EMA (or SWA) copy of the weights beside it, the pointer grew past
    1 MiB and named the first save's commit as it was, its loops and callbacks' progress lost."""
    io = CkptflowIO(str(tmp_path / "store"), "r")
    callbacks = {"EMA": {"t": torch.zeros(1 << 19)}, "ModelCheckpoint": {"best": 1.0}}
    first = {"global_step": 3, "state_dict": {"w": torch.ones(2)}, "loops": {"done": 1}, "callbacks": callbacks}
    io.save_checkpoint(first, tmp_path / "a.ckpt")
    later = {**first, "loops": {"done": 2}, "callbacks": {**callbacks, "ModelCheckpoint": {"best": 0.5}}}
    io.save_checkpoint(later, tmp_path / "b.ckpt")
    loaded = io.load_checkpoint(tmp_path / "b.ckpt")
    assert loaded["loops"] == {"done": 2} and loaded["callbacks"]["ModelCheckpoint"] == {"best": 0.5}
    assert torch.equal(loaded["callbacks"]["EMA"]["t"], torch.zeros(1 << 19))


def test_last_falling_back_applies_the_recorded_later_save_and_names_a_damaged_record(tmp_path):
    root = tmp_path / "store"
    io = CkptflowIO(str(root), "r")
    io.save_checkpoint(full_save(3), tmp_path / "s3.ckpt")
    io.save_checkpoint({**full_save(3), "loops": {"done": 2}}, tmp_path / "later3.ckpt")  # its own pointer aside
    io.save_checkpoint({**full_save(5), "state_dict": {"w": torch.full((2,), 5.0)}}, tmp_path / "last.ckpt")
    corrupt_chunk(root, "r", 5, only_in(root, "r", 5, 3)[0])

    fresh = CkptflowIO(str(root), "r")
    loaded = fresh.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 3 and loaded["loops"] == {"done": 2}  # the newest save at step 3

    [key] = [i.key for i in open_store(str(root)).list("lifecycle/r/") if i.key.endswith("/trainer.json")]
    record = json.loads((root / key).read_text())
    (root / key).write_text(json.dumps({**record, "changes": {"overlay": 5}}))
    with pytest.raises(CkptflowError, match=r"trainer record of run 'r' step 3.*damaged: delete it"):
        CkptflowIO(str(root), "r").load_checkpoint(tmp_path / "last.ckpt")


def test_last_falling_back_past_a_weights_only_later_save_resumes_with_the_whole_state(tmp_path):
    """A weights-only save after the full ones at step 3 replaced the trainer record with its
    'dropped': falling back to step 3 then resumed with no optimizer state, loops or callbacks."""
    root = tmp_path / "store"
    io = CkptflowIO(str(root), "r")
    io.save_checkpoint(full_save(3), tmp_path / "s3.ckpt")
    io.save_checkpoint({**full_save(3), "loops": {"done": 2}}, tmp_path / "later3.ckpt")
    io.save_checkpoint({"global_step": 3, "epoch": 0, "state_dict": {"w": torch.ones(2)}}, tmp_path / "w3.ckpt")
    io.save_checkpoint({**full_save(5), "state_dict": {"w": torch.full((2,), 5.0)}}, tmp_path / "last.ckpt")
    corrupt_chunk(root, "r", 5, only_in(root, "r", 5, 3)[0])

    loaded = CkptflowIO(str(root), "r").load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 3 and sorted(loaded) == sorted(full_save())
    assert loaded["loops"] == {"done": 2}  # the newest whole save's changes
    assert sorted(io.load_checkpoint(tmp_path / "w3.ckpt")) == ["epoch", "global_step", "state_dict"]


def test_a_later_save_whose_pointer_failed_to_be_written_leaves_the_trainer_record(tmp_path, monkeypatch):
    root = tmp_path / "store"
    io = CkptflowIO(str(root), "r")
    io.save_checkpoint(full_save(3), tmp_path / "s3.ckpt")
    io.save_checkpoint({**full_save(3), "loops": {"done": 2}}, tmp_path / "later3.ckpt")
    [key] = [i.key for i in open_store(str(root)).list("lifecycle/r/") if i.key.endswith("/trainer.json")]
    before = (root / key).read_bytes()

    def full_disk(path, blob):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lightning, "_write_whole", full_disk)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({**full_save(3), "loops": {"done": 3}}, tmp_path / "failed3.ckpt")
    assert (root / key).read_bytes() == before and not (tmp_path / "failed3.ckpt").exists()


def test_the_run_index_of_lifecycle_records_keeps_trainer_scores_not_their_changes(tmp_path):
    """Each later save's changes (here an EMA-like callback of 256 KiB changed at every step) went
    into the run's lifecycle index that the inventory, retention and restore's selectors read:
    the index grew by the changes of every step (2.8 MB for 8 steps; now a few KB)."""
    root = tmp_path / "store"
    io = CkptflowIO(str(root), "r")
    for step in range(1, 9):
        first = {"global_step": step, "state_dict": {"w": torch.ones(2)}, "callbacks": {"EMA": {"t": torch.zeros(1)}}}
        io.save_checkpoint(first, tmp_path / f"a{step}.ckpt")
        later = {**first, "callbacks": {"EMA": {"t": torch.full((1 << 16,), float(step))}}}
        io.save_checkpoint(later, tmp_path / f"b{step}.ckpt")
    store = open_store(str(root))
    records = lifecycle.records_by_subject(store, "r")
    assert len(records) == 8 and all(set(kinds) == {"trainer"} for kinds in records.values())
    assert all("changes" not in kinds["trainer"] for kinds in records.values())
    [index] = [i for i in store.list("index/lifecycle/")]
    assert index.size < 64 << 10
    loaded = io.load_checkpoint(tmp_path / "b8.ckpt")  # the changes themselves are where the plugin reads them
    assert torch.equal(loaded["callbacks"]["EMA"]["t"], torch.full((1 << 16,), 8.0))


def test_last_falling_back_past_a_whole_save_whose_callback_state_emptied_resumes_with_its_changes(tmp_path):
    """Lightning leaves out a callback whose ``state_dict()`` is empty: a full later save at step 3
    after such a callback's state emptied names it in 'dropped', yet holds the optimizer states,
    loops and callbacks. It is a whole save: its changes (loops after validation) go into the
    trainer record, or 'last' falling back to step 3 resumes from before that validation."""
    root = tmp_path / "store"
    io = CkptflowIO(str(root), "r")
    first = {**full_save(3), "callbacks": {**full_save(3)["callbacks"], "Pending": {"queue": [1]}}}
    io.save_checkpoint(first, tmp_path / "s3.ckpt")
    later = {**full_save(3), "loops": {"done": 2}}  # "Pending" emptied: Lightning leaves it out
    io.save_checkpoint(later, tmp_path / "later3.ckpt")
    io.save_checkpoint({**full_save(5), "state_dict": {"w": torch.full((2,), 5.0)}}, tmp_path / "last.ckpt")
    corrupt_chunk(root, "r", 5, only_in(root, "r", 5, 3)[0])

    loaded = CkptflowIO(str(root), "r").load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 3 and loaded["loops"] == {"done": 2}
    assert sorted(loaded["callbacks"]) == ["EMA", "ModelCheckpoint"]
