"""The host copy an async save writes from, made into buffers kept for the Checkpointer's
life (``Checkpointer.prepare`` allocates them before the first save).

DCP's ``StateDictStager`` does the copying: it deep-copies the state's structure, keeps one
host buffer per tensor storage (pinned where CUDA is present) and reuses it while that
storage lives. ``DefaultStager``, DCP's wrapper around it, is not used: some torch releases
(2.11) close its ``StateDictStager`` after every stage, which empties the buffer cache (every
save pinned gigabytes afresh, seconds of a blocked loop) and its copy dispatch table (the
second async save failed with ``KeyError: <class 'type'>``). This stager holds one
``StateDictStager`` open until ``close``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager


class CachedStager(AsyncStager):
    """Stages synchronously: when ``stage`` returns, the copy is complete (CUDA copies are
    queued without blocking, then waited for once), so the save's writer threads may read
    it and training may write the live tensors."""

    _synchronize_after_execute = False  # nothing left to wait for after ``stage``

    def __init__(self, *, pinned: bool):
        self.pinned = pinned
        self._stager = StateDictStager(pin_memory=pinned, share_memory=False)

    def stage(self, state_dict: Any) -> Any:
        staged = self._stager.stage(state_dict, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a complete copy."""
        return None

    def close(self) -> None:
        self._stager.close()
