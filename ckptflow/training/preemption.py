"""Save on preemption: a signal makes the next step boundary checkpoint, then the process exits.

A scheduler that reclaims a node (SLURM, Kubernetes, a spot VM) sends SIGTERM (or SIGUSR1,
configurable) some seconds before it kills the job. Opted in, ``PreemptionHandler``
records the signal and does nothing else in the handler (a save cannot safely start in the
middle of a step). The training loop calls ``check(step, state)`` at each step boundary:
once a signal arrived, it waits for the async save in flight (a failure of it is logged,
not raised: it must not cost the save of this step), writes a checkpoint of
``step`` synchronously unless that step is already committed, and exits with status 128 +
the signal number (or returns True, with ``exit=False``). A later ``restore`` starts
exactly at that step.

On several ranks the signal may reach one rank only. Each ``check`` is one collective
(a max over the ranks of the signal number, on a gloo group of its own, apart from the
checkpointer's, which an async save uses from a background thread), so every rank sees
the request at the same step and they write one consistent checkpoint. ``check_every``
spaces the collective out when a step is very short.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import MutableMapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckptflow.dcp.collectives import new_gloo_group
from ckptflow.dcp.failures import describe_causes, unwrap_failures
from ckptflow.training.checkpointer import Checkpointer

log = logging.getLogger("ckptflow")


class PreemptionHandler:
    """Create it on every rank at the same point (it creates a process group), after the
    ``Checkpointer``; ``close()`` (or leaving its ``with`` block) puts the old handlers back."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        check_every: int = 1,
        exit: bool = True,
    ):
        if check_every < 1:
            raise ValueError(f"check_every must be a positive number of steps, got {check_every!r}")
        if not signals:
            raise ValueError("signals must name at least one signal (SIGTERM, SIGUSR1, ...)")
        self.checkpointer, self.check_every, self.exit = checkpointer, check_every, exit
        self.received: int = 0  # the signal number this process received (0: none)
        self.saved_step: int | None = None
        group = checkpointer.group
        self._pg = new_gloo_group() if group.active else None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only a flag: the save happens at the next step boundary

    def requested(self, step: int) -> int:
        """The signal any rank received, 0 if none (a collective on every ``check_every``-th step)."""
        if self._pg is None:
            return self.received
        if step % self.check_every:
            return 0
        box = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._pg)
        return int(box.item())

    def check(self, step: int, state: MutableMapping[str, Any], *, metadata: dict | None = None) -> bool:
        """Call after step ``step`` is complete, on every rank. On a preemption request:
        checkpoint ``step`` (synchronously; the async save in flight is waited for first),
        then exit with 128 + the signal number, or return True with ``exit=False``."""
        signum = self.requested(step)
        if not signum:
            return False
        ckpt = self.checkpointer
        self._wait_for_save_in_flight(ckpt)
        if ckpt.last_committed_step != step:
            name = signal.Signals(signum).name
            ckpt.save(step, state, kind="incremental", metadata={**(metadata or {}), "preempted_by": name})
        self.saved_step = step
        if self.exit:
            ckpt.close()
            if self._pg is not None:  # every rank leaves together; a group torn down at exit aborts
                dist.barrier(group=self._pg)
                dist.destroy_process_group()
            sys.exit(128 + signum)
        return True

    @staticmethod
    def _wait_for_save_in_flight(ckpt: Checkpointer) -> None:
        """Wait for the async save in flight; if it failed, say so and go on: the save of
        this step is then the only one that can keep the work since the last commit, and
        raising the earlier failure here ended the job without it (a restart lost every
        step since the previous commit)."""
        pending = ckpt._pending
        if pending is None:
            return
        try:
            ckpt.wait()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is not an Exception
            causes = describe_causes(unwrap_failures(e))
            log.error(
                "preempted while the async save of run %r step %d was in flight: it failed and was not "
                "committed (%s); saving the current step instead",
                ckpt.run,
                pending.step,
                causes,
            )

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
