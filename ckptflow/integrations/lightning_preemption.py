"""Save on preemption in PyTorch Lightning: ``CkptflowPreemption``, a callback beside ``CkptflowIO``.

``Trainer(plugins=[CkptflowIO(root, run)], callbacks=[CkptflowPreemption(dirpath)])``: the
signal handler (SIGTERM by default) only sets a flag; at the end of the training batch during
which any rank received it (the strategy's ``reduce_boolean_decision``: one collective), the
trainer saves that step (committed through ``CkptflowIO``; the pointer file goes to
``dirpath``) and stops, so ``fit`` returns and the job exits before the scheduler kills it.
``fit(ckpt_path=callback.saved_path)`` resumes exactly there.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

try:
    from pytorch_lightning import Callback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ckptflow.integrations.lightning_preemption needs pytorch-lightning") from e


class CkptflowPreemption(Callback):
    def __init__(self, dirpath: str | os.PathLike, *, signals: Sequence[int] = (signal.SIGTERM,)):
        if not signals:
            raise ValueError("signals must name at least one signal (SIGTERM, SIGUSR1, ...)")
        self.dirpath, self.signals = os.fspath(dirpath), tuple(signals)
        self.received = 0
        self.saved_step: int | None = None
        self.saved_path: str | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only a flag: the save happens at the end of the batch

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and not self._previous:  # in each process: ddp_spawn copies the callback
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.strategy.reduce_boolean_decision(bool(self.received), all=False):
            return
        step = trainer.global_step
        path = os.path.join(self.dirpath, f"preempted-step{step}.ckpt")
        trainer.save_checkpoint(path)
        self.saved_step, self.saved_path = step, path
        trainer.should_stop = True
