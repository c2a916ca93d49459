"""Item 8 of issue 9: the Hugging Face ``transformers.Trainer`` through ``CkptflowTrainer``,
with the real transformers and accelerate on CPU.

A tiny GPT-2 (built from a config; dropout on, so the RNG matters) trains on generated
tokens with ``save_steps``; the run is killed between checkpoints, a new Trainer (the
global RNG scrambled) resumes with ``resume_from_checkpoint=True``, and the loss of
every step after the checkpoint is bit-equal to an uninterrupted run's. No
``checkpoint-N`` directory (and so no pickle) is written.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckptflow import Checkpointer, CkptflowError, NoValidCheckpointError, lifecycle
from ckptflow.catalog import recovery_log
from ckptflow.integrations.hf import CkptflowTrainer
from ckptflow.interop.export import export_safetensors
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk, only_in

pytestmark = pytest.mark.slow  # the real transformers Trainer, trained and resumed: make test-e2e

MAX_STEPS, SAVE_STEPS = 12, 4  # 10 steps per epoch: the run crosses an epoch boundary


@pytest.fixture(autouse=True)
def quiet():
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Crash(TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise RuntimeError("killed")


class Recording(CkptflowTrainer):
    """Keeps the exact loss of every training step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.losses.append((out[0] if return_outputs else out).detach().clone())
        return out


def dataset() -> list[dict]:
    ids = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16))


def make(tmp_path, run: str, crash_at: int | None = None, seed: int = 0, select="latest", **args) -> Recording:
    arguments = TrainingArguments(
        output_dir=str(tmp_path / run), max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2, report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0, **args,
    )  # fmt: skip
    return Recording(
        model=gpt2(seed),
        args=arguments,
        train_dataset=dataset(),
        eval_dataset=dataset()[:8] if args.get("eval_strategy") else None,
        callbacks=[Crash(crash_at)] if crash_at is not None else [],
        ckptflow_root=str(tmp_path / "store"),
        ckptflow_run=run,
        ckptflow_select=select,
    )


def uninterrupted(tmp_path) -> tuple[torch.Tensor, Recording]:
    trainer = make(tmp_path, "full")
    trainer.train()
    return torch.stack(trainer.losses), trainer


def killed_at(tmp_path, step: int) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        make(tmp_path, "part", crash_at=step).train()


def resume(tmp_path, **kwargs) -> Recording:
    trainer = make(tmp_path, "part", seed=1)
    torch.manual_seed(999)  # whatever the RNG is now, the checkpoint's is what counts
    trainer.train(resume_from_checkpoint=True, **kwargs)
    return trainer


def test_killed_run_resumes_bit_for_bit(tmp_path):
    full, done = uninterrupted(tmp_path)
    assert len(full) == MAX_STEPS
    killed_at(tmp_path, 6)  # two steps after the checkpoint at step 4

    trainer = resume(tmp_path)
    assert torch.equal(torch.stack(trainer.losses), full[SAVE_STEPS:])  # bit for bit
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, done.model.state_dict()[name]), name
    assert trainer.state.global_step == MAX_STEPS
    assert not [d for d in os.listdir(tmp_path / "part") if d.startswith("checkpoint-")]  # nothing pickled

    infos = trainer.checkpointer.list()
    assert [i.step for i in infos] == [4, 8, 12]
    meta = infos[0].metadata
    assert meta["model_config"]["architectures"] == ["GPT2LMHeadModel"] and meta["global_step"] == 4
    assert meta["loss"] > 0 and "learning_rate" in meta


def test_newest_damaged_checkpoint_is_skipped_and_saved_again(tmp_path):
    full, _ = uninterrupted(tmp_path)
    killed_at(tmp_path, 10)  # checkpoints at 4 and 8
    root = tmp_path / "store"
    corrupt_chunk(root, "part", 8, only_in(root, "part", 8, 4)[0])

    trainer = resume(tmp_path)
    assert torch.equal(torch.stack(trainer.losses), full[SAVE_STEPS:])  # from step 4
    with Checkpointer(str(root), "part") as ck:
        assert ck.verify(8).ok  # step 8 saved again over the damaged one


def test_resume_to_the_newest_validated_checkpoint(tmp_path):
    full, _ = uninterrupted(tmp_path)
    killed_at(tmp_path, 10)  # checkpoints at 4 and 8
    root = tmp_path / "store"
    corrupt_chunk(root, "part", 8, only_in(root, "part", 8, 4)[0])
    store = open_store(str(root))
    assert lifecycle.validate(store, "part", 4)["ok"] and not lifecycle.validate(store, "part", 8)["ok"]

    trainer = make(tmp_path, "part", seed=1, select="validated")
    torch.manual_seed(999)
    trainer.train(resume_from_checkpoint=True)
    assert torch.equal(torch.stack(trainer.losses), full[SAVE_STEPS:])  # from step 4
    [record] = recovery_log.read_all(store, "part")
    assert record["select"] == "validated" and record["step"] == 4 and record["skipped"] == []
    assert [s for s, _ in record["passed_over"]] == [8]  # failed validation: never tried, then saved over
    assert trainer.checkpointer.verify(8).ok


def test_an_exported_checkpoint_loads_with_from_pretrained(tmp_path):
    _, trainer = uninterrupted(tmp_path)
    export_safetensors(str(tmp_path / "store"), "full", tmp_path / "model", step=MAX_STEPS)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trainer.model.eval()(ids).logits)


def test_resume_without_checkpoints_says_so(tmp_path):
    with pytest.raises(NoValidCheckpointError, match="no checkpoints at all"):
        make(tmp_path, "empty").train(resume_from_checkpoint=True)


def test_best_model_tracking_is_refused(tmp_path):
    with pytest.raises(CkptflowError, match="load_best_model_at_end"):
        make(tmp_path, "best", load_best_model_at_end=True, eval_strategy="steps", eval_steps=SAVE_STEPS)


class Signal(TrainerCallback):
    """Delivers ``signum`` to this process during step ``at`` (as a scheduler would)."""

    def __init__(self, at: int, signum: int):
        self.at, self.signum = at, signum

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            import signal

            signal.raise_signal(self.signum)


def test_a_preemption_signal_saves_that_step_and_stops_then_resume_starts_there(tmp_path):
    import signal

    trainer = make(tmp_path, "pre")
    trainer = Recording(
        model=gpt2(0), args=trainer.args, train_dataset=dataset(), callbacks=[Signal(5, signal.SIGUSR1)],
        ckptflow_root=str(tmp_path / "store"), ckptflow_run="pre", ckptflow_preemption=(signal.SIGUSR1,),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.preemption.saved_step == 6  # stopped after the signalled step
    trainer.preemption.close()
    with Checkpointer(str(tmp_path / "store"), "pre") as ckpt:
        assert [i.step for i in ckpt.list()] == [4, 6]
    resumed = make(tmp_path, "pre", seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert len(resumed.losses) == MAX_STEPS - 6  # resumed exactly at the signalled step


def test_a_preemption_save_mid_epoch_with_epoch_saves_returns_and_resumes(tmp_path):
    """save_strategy="epoch": the preemption save at the signalled step's end was followed
    by the Trainer's epoch-end save at the same step, committed again: CheckpointExistsError
    out of train(), a preempted job dying with a traceback. Now the second one commits nothing."""
    import signal

    trainer = make(tmp_path, "pre", save_strategy="epoch")
    trainer = Recording(
        model=gpt2(0), args=trainer.args, train_dataset=dataset(), callbacks=[Signal(3, signal.SIGUSR1)],
        ckptflow_root=str(tmp_path / "store"), ckptflow_run="pre", ckptflow_preemption=(signal.SIGUSR1,),
    )  # fmt: skip
    trainer.train()
    trainer.preemption.close()
    assert trainer.state.global_step == 4 and trainer.preemption.saved_step == 4
    with Checkpointer(str(tmp_path / "store"), "pre") as ckpt:
        assert [i.step for i in ckpt.list()] == [4]
    resumed = make(tmp_path, "pre", seed=1, save_strategy="epoch")
    resumed.train(resume_from_checkpoint=True)
    assert len(resumed.losses) == MAX_STEPS - 4
