"""Hugging Face ``transformers.Trainer`` checkpoints through ckptflow.

``CkptflowTrainer`` is a ``Trainer`` (``CkptflowTrainerMixin`` puts the same behaviour
in front of any ``Trainer`` subclass: ``class MyTrainer(CkptflowTrainerMixin,
SFTTrainer)``). It takes ``ckptflow_root`` and ``ckptflow_run`` (and optional
``ckptflow_options``, keyword arguments of ``Checkpointer``; the ``Checkpointer`` is made
once the Trainer has set up ``torch.distributed``, so every rank joins it).

Saving: wherever the Trainer would write ``checkpoint-N/`` (``save_steps``,
``save_strategy="epoch"``), the model, optimizer, LR scheduler, gradient scaler, RNG
states and trainer state (``trainer_state.json``'s content, stateful callbacks
included) are committed as checkpoint ``global_step`` of the run instead: no pickle,
no ``checkpoint-N`` directory. The metadata holds the model's config (so ``ckptflow
export`` writes a model directory) and the numbers logged at that step (``loss``,
``eval_loss``: what retention's best-K reads).

Resuming: ``trainer.train(resume_from_checkpoint=True)`` resumes from the newest
checkpoint of the run that verifies (damaged ones are skipped, as ``restore`` does;
none at all raises ``NoValidCheckpointError``), or the one ``ckptflow_select`` chooses
(``"validated"``, ``Best(...)``, ``Alias(...)``: ``ckptflow.catalog.selection``); an
int resumes from exactly that step; a path is the Trainer's own directory checkpoint,
as before. The Trainer's own resume path runs unchanged (it skips the batches already seen and restores the RNG where it
would), fed from the loaded checkpoint through its ``_load_*`` hooks; only
``trainer_state.json`` is written, to a temporary directory, because the Trainer reads
it from a path.

Not supported (refused at construction): ``load_best_model_at_end`` and
``save_strategy="best"`` (they need the Trainer's checkpoint directories), DeepSpeed.
``save_total_limit`` does not apply: the store's retention decides what is kept.

One commit per step: a second save the Trainer asks for at a step this trainer committed
(a preemption save, then ``save_strategy="epoch"``'s at the epoch end) commits nothing.

Preemption: ``ckptflow_preemption=(signal.SIGTERM,)`` installs a ``PreemptionHandler``
(``ckptflow.training.preemption``); at the end of the step where any rank has received one
of those signals (one collective agrees), the Trainer saves that step through ckptflow and
stops training, so ``train()`` returns and the job can exit before the scheduler kills it.

This relies on the Trainer's ``_save_checkpoint`` and ``_load_*`` methods, which are
not public API; tested with transformers 5.24.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from ckptflow.catalog import selection
from ckptflow.catalog.selection import Selector
from ckptflow.errors import CkptflowError
from ckptflow.interop.export.architecture import model_metadata
from ckptflow.training.checkpointer import Checkpointer
from ckptflow.training.preemption import PreemptionHandler
from ckptflow.training.state import capture_rng, load_state_dicts, restore_rng

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ckptflow.integrations.hf needs transformers: pip install 'ckptflow[hf]'") from e

TRAINER_STATE = "trainer_state.json"
_RESUME_PREFIX = "ckptflow-resume-"


class CkptflowTrainerMixin:
    """Checkpoints of a ``transformers.Trainer`` through ckptflow (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        ckptflow_root: Any,
        ckptflow_run: str,
        ckptflow_options: dict[str, Any] | None = None,
        ckptflow_select: Selector = "latest",
        ckptflow_preemption: Sequence[int] = (),
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        trainer: Any = self
        if trainer.args.load_best_model_at_end or str(trainer.args.save_strategy).endswith("best"):
            raise CkptflowError(
                "load_best_model_at_end and save_strategy='best' need the Trainer's own checkpoint directories; "
                "with ckptflow, pick the best checkpoint from its metadata (ckptflow ls, retention's best-K) instead"
            )
        if trainer.is_deepspeed_enabled:
            raise CkptflowError(
                "DeepSpeed checkpoints its own engine state; ckptflow does not save it through the Trainer"
            )
        self.checkpointer = Checkpointer(ckptflow_root, ckptflow_run, **(ckptflow_options or {}))
        self.ckptflow_select = selection.check(ckptflow_select)  # what resume_from_checkpoint=True recovers to
        self.preemption: PreemptionHandler | None = None
        if ckptflow_preemption:
            self.preemption = PreemptionHandler(self.checkpointer, signals=tuple(ckptflow_preemption), exit=False)
            trainer.add_callback(_SaveOnPreemption(self.preemption))
        self._ckptflow_resume: tuple[str, dict[str, Any]] | None = None  # (temporary directory, loaded state)
        self._ckptflow_saved: int | None = None  # the step this trainer committed last

    # ---- save -------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Commit this step; a second save at a step this trainer committed commits nothing
        (a checkpoint per step is create-only): the Trainer asks twice when a preemption
        save at a step end is followed by ``save_strategy="epoch"``'s save at the epoch end."""
        trainer: Any = self
        if trainer.state.global_step == self._ckptflow_saved:
            return
        trainer.store_flos()
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
            name, cb_state = type(cb).__name__, cb.state()  # as the Trainer records stateful callbacks
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(cb_state)
            else:
                trainer.state.stateful_callbacks[name] = cb_state
        step = trainer.state.global_step
        state: dict[str, Any] = {"model": trainer.model}
        if not trainer.args.save_only_model:
            state.update(optimizer=_inner(trainer.optimizer), scheduler=trainer.lr_scheduler)
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = capture_rng()
        state["trainer_state"] = json.loads(json.dumps(dataclasses.asdict(trainer.state)))  # as save_to_json
        self.checkpointer.save(step, state, metadata={**model_metadata(trainer.model), **_logged(trainer.state, step)})
        self._ckptflow_saved = step

    # ---- resume -----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | int | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True or (
            isinstance(resume_from_checkpoint, int) and not isinstance(resume_from_checkpoint, bool)
        ):
            if resume_from_checkpoint is True:
                _, state = self.checkpointer.load(select=self.ckptflow_select)
            else:
                _, state = self.checkpointer.load(step=int(resume_from_checkpoint))
            if "trainer_state" not in state:
                raise CkptflowError(f"run {self.checkpointer.run!r}: the checkpoint holds no trainer state")
            directory = tempfile.mkdtemp(prefix=_RESUME_PREFIX)
            with open(os.path.join(directory, TRAINER_STATE), "w", encoding="utf-8") as f:
                json.dump(state["trainer_state"], f)
            self._ckptflow_resume = (directory, state)
            try:
                return super().train(directory, *args, **kwargs)  # type: ignore[misc]
            finally:
                self._ckptflow_resume = None
                shutil.rmtree(directory, ignore_errors=True)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _resumed(self, checkpoint: str | None) -> dict[str, Any] | None:
        resume = self._ckptflow_resume
        return resume[1] if resume is not None and checkpoint == resume[0] else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        state = self._resumed(resume_from_checkpoint)
        if state is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        load_state_dicts({"model": model if model is not None else self.model}, {"model": state["model"]})  # type: ignore[attr-defined]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        trainer: Any = self
        live = {"model": trainer.model, "optimizer": _inner(trainer.optimizer), "scheduler": trainer.lr_scheduler}
        load_state_dicts(live, {k: state[k] for k in ("optimizer", "scheduler") if k in state})

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if "rng" in state:
            trainer: Any = self
            restore_rng(state["rng"], f"run {self.checkpointer.run!r} step {trainer.state.global_step}")


class _SaveOnPreemption(TrainerCallback):
    """At the end of a step where a rank was signalled: save this step, then stop."""

    def __init__(self, handler: PreemptionHandler):
        self.handler = handler

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.handler.requested(state.global_step):
            control.should_save = True
            control.should_training_stop = True
            self.handler.saved_step = state.global_step
        return control


class CkptflowTrainer(CkptflowTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through ckptflow."""


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _logged(state: Any, step: int) -> dict[str, float]:
    """The numbers the Trainer logged at ``step`` (loss, eval_loss, ...), as metadata."""
    out: dict[str, float] = {"global_step": step, "epoch": float(state.epoch or 0.0)}
    for entry in state.log_history:
        if entry.get("step") == step:
            out.update(
                {
                    k: v
                    for k, v in entry.items()
                    if type(v) in (int, float) and math.isfinite(v) and k not in ("step", "epoch")
                }
            )
    return out
