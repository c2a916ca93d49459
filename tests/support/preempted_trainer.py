"""Child process for training/test_preemption.py: trains until preempted, saving on the signal.

usage: preempted_trainer.py STORE RANK WORLD PORT

Weights are a pure function of the step (``w = arange(N) + step``), so whoever restores can
check them exactly. Saves every 7 steps, async; prints ``step N`` after each step, and the
``PreemptionHandler`` (SIGTERM and SIGUSR1) saves at the step boundary after a signal and
exits with 128 + the signal number. Several ranks join a gloo group on 127.0.0.1:PORT.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ckptflow import Checkpointer, NoValidCheckpointError, PreemptionHandler

RUN, N = "preempted", 1000


def main() -> None:
    root, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    base = torch.arange(N, dtype=torch.float64)
    state = {"w": torch.zeros(N, dtype=torch.float64), "step": -1}
    ckpt = Checkpointer(root, RUN, threads=2)
    try:
        step = ckpt.restore(state).step + 1
    except NoValidCheckpointError:
        step = 0
    preempt = PreemptionHandler(ckpt, signals=(signal.SIGTERM, signal.SIGUSR1))
    print("ready", flush=True)
    while True:
        state["w"].copy_(base + step)  # "training": the step's update
        state["step"] = step
        time.sleep(0.01)
        if step % 7 == 0:
            ckpt.save(step, state, blocking=False)
        print("step", step, flush=True)
        preempt.check(step, state)  # exits after saving, once any rank got a signal
        step += 1


if __name__ == "__main__":
    main()
