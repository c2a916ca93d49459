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
    queued without blocking, then waited for on every device that holds some of the state:
    ``torch.cuda.synchronize()`` alone waits for the current device only, and a process may
    hold a model across several, ``device_map="auto"``), so the save's writer threads may
    read it and training may write the live tensors.

    Host buffers are pinned only for a state with tensors on a CUDA device: pinning the
    copy of a CPU state gains nothing, and on a GPU machine it would start a CUDA context
    (seconds, and GPU memory) in a process that never used the GPU."""

    _synchronize_after_execute = False  # nothing left to wait for after ``stage``

    def __init__(self) -> None:
        self.pinned = False
        self._stager = StateDictStager(pin_memory=False, share_memory=False)

    def stage(self, state_dict: Any) -> Any:
        devices = _cuda_devices(state_dict)
        pinned = bool(devices)
        if pinned != self.pinned:  # the buffers kept so far are of the other kind
            self._stager.close()
            self._stager, self.pinned = StateDictStager(pin_memory=pinned, share_memory=False), pinned
        staged = self._stager.stage(state_dict, non_blocking=pinned)
        for device in devices:
            torch.cuda.synchronize(device)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a complete copy."""
        return None

    def close(self) -> None:
        self._stager.close()


def _cuda_devices(state_dict: Any) -> set[torch.device]:
    """The CUDA devices the tensors of a flat state dict (``flatten_on_every_rank``'s) live on."""
    return {v.device for v in state_dict.values() if isinstance(v, torch.Tensor) and v.device.type == "cuda"}
