"""Save on preemption (``PreemptionHandler``): a signal at a random step, and the restore starts there."""

import logging
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer, PreemptionHandler
from ckptflow.chunks.io import ChunkStore
from ckptflow.errors import StoreUnavailableError
from support import preempted_trainer
from support.dist_workers import free_port

TRAINER = Path(preempted_trainer.__file__)


def _start(root: str, world: int) -> list[subprocess.Popen]:
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, str(TRAINER), root, str(rank), str(world), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def _preempt(root: str, *, world: int, target: int, signum: int, seed: int) -> tuple[int, int]:
    """Start ``world`` ranks, signal one of them (chosen by ``seed``) once it reports a random
    step; the step they saved at and the signalled step."""
    procs = _start(root, world)
    victim = procs[random.Random(seed).randrange(world)]
    try:
        assert victim.stdout is not None
        signalled = None
        for line in victim.stdout:
            words = line.split()
            if words[:1] == ["step"] and int(words[1]) >= target:
                signalled = int(words[1])
                victim.send_signal(signum)
                break
        assert signalled is not None, victim.stderr.read() if victim.stderr else ""
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [128 + signum] * world, (codes, [err[-3000:] for _, err in outs])
    last = [
        max((int(w[1]) for w in map(str.split, out.splitlines()) if w[:1] == ["step"]), default=-1) for out, _ in outs
    ]
    last[procs.index(victim)] = max(last[procs.index(victim)], signalled)  # its earlier lines were read above
    assert len(set(last)) == 1, f"ranks stopped at different steps: {last}"
    return last[0], signalled


def _restored_step(root: str) -> int:
    state = {"w": torch.zeros(preempted_trainer.N, dtype=torch.float64), "step": -1}
    with Checkpointer(root, preempted_trainer.RUN) as ckpt:
        result = ckpt.restore(state)
    assert torch.equal(state["w"], torch.arange(preempted_trainer.N, dtype=torch.float64) + result.step)
    assert state["step"] == result.step
    return result.step


@pytest.mark.parametrize(("world", "signum"), [(1, signal.SIGTERM), (2, signal.SIGUSR1)])
def test_a_signal_at_a_random_step_saves_that_step_and_the_restore_starts_there(tmp_path, world, signum):
    root = str(tmp_path / "store")
    target = random.Random(world).randrange(3, 40)
    stopped, signalled = _preempt(root, world=world, target=target, signum=signum, seed=world)
    assert stopped >= signalled >= target
    assert _restored_step(root) == stopped  # not the last periodic save (every 7 steps): the signalled one


def test_the_handler_returns_true_without_exit_and_puts_the_old_handler_back(tmp_path):
    state = {"w": torch.ones(4)}
    previous = signal.getsignal(signal.SIGUSR1)
    with Checkpointer(str(tmp_path), "r") as ckpt, PreemptionHandler(ckpt, signals=(signal.SIGUSR1,), exit=False) as h:
        assert not h.check(1, state)
        signal.raise_signal(signal.SIGUSR1)
        assert h.check(2, state) and h.saved_step == 2
        info = ckpt.list()[-1]
        assert (info.step, info.metadata["preempted_by"]) == (2, "SIGUSR1")
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_a_signal_at_a_step_whose_async_save_is_in_flight_waits_for_it_instead_of_saving_twice(tmp_path):
    state = {"w": torch.arange(1000.0)}
    with Checkpointer(str(tmp_path), "r") as ckpt, PreemptionHandler(ckpt, signals=(signal.SIGUSR1,), exit=False) as h:
        ckpt.save(7, state, blocking=False)  # still in flight, or just committed
        signal.raise_signal(signal.SIGUSR1)
        assert h.check(7, state) and h.saved_step == 7
        [info] = ckpt.list()
        assert info.step == 7 and "preempted_by" not in info.metadata  # the async save is the checkpoint


def test_a_signal_while_an_async_save_fails_still_saves_the_step_and_says_which_save_was_lost(
    tmp_path, monkeypatch, caplog
):
    """The failure of the save in flight was raised by ``check``: the job ended without the
    preemption checkpoint, and a restart went back to the last commit before it."""
    real_put, outage = ChunkStore.put, threading.Event()
    outage.set()

    def put(self, *args, **kwargs):
        if outage.is_set():  # one failure: the outage is over after it
            outage.clear()
            raise StoreUnavailableError("injected: a transient outage")
        return real_put(self, *args, **kwargs)

    state = {"w": torch.arange(1000.0)}
    with Checkpointer(str(tmp_path), "r") as ckpt, PreemptionHandler(ckpt, signals=(signal.SIGUSR1,), exit=False) as h:
        monkeypatch.setattr(ChunkStore, "put", put)
        ckpt.save(7, state, blocking=False)
        signal.raise_signal(signal.SIGUSR1)
        state["w"] += 1
        with caplog.at_level(logging.ERROR, logger="ckptflow"):
            assert h.check(8, state) and h.saved_step == 8
        assert [info.step for info in ckpt.list()] == [8]
    assert "the async save of run 'r' step 7 was in flight: it failed and was not committed" in caplog.text
    assert "injected: a transient outage" in caplog.text
