"""Child process for training/test_crashes.py's SIGKILL test: resume, then save forever.

usage: sigkill_saver.py STORE RUN N CHUNK_BYTES

Weights are a pure function of the step (``w = arange(N) + step``, ``v = -arange(N)/2 -
step``), so whoever restores can check them exactly. Saves alternate between blocking
and async, and never end: the parent kills this process with SIGKILL.
"""

import sys

import torch

from ckptflow import Checkpointer, NoValidCheckpointError


def main() -> None:
    root, run, n, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    base = torch.arange(n, dtype=torch.float64)
    state = {"w": torch.zeros(n, dtype=torch.float64), "v": torch.zeros(n, dtype=torch.float64), "step": -1}
    ck = Checkpointer(root, run=run, chunk_bytes=chunk, threads=2)
    try:
        step = ck.restore(state).step + 1
    except NoValidCheckpointError:
        step = 1
    while True:
        state["w"].copy_(base + step)
        state["v"].copy_(base * -0.5 - step)
        state["step"] = step
        if step % 2:
            ck.save(step, state)
        else:
            ck.save(step, state, blocking=False).wait()
        print("committed", step, flush=True)
        step += 1


if __name__ == "__main__":
    main()
