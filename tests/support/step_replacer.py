"""Child process for catalog/test_commit.py: restore past a damaged step, then race to save it.

usage: step_replacer.py STORE RUN STEP VALUE GO_FILE DELAY

Prints "ready" once restored, waits for GO_FILE to exist and DELAY seconds more, saves
STEP with every tensor VALUE, and prints "committed" or "exists" (CheckpointExistsError).
"""

import os
import sys
import time

import torch

from ckptflow import Checkpointer, CheckpointExistsError


def main() -> None:
    root, run, step, value, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    delay = float(sys.argv[6])
    torch.set_num_threads(1)
    with Checkpointer(root, run, threads=2) as ck:
        ck.restore({"w": torch.zeros(64), "v": torch.zeros(32)})
        print("ready", flush=True)
        while not os.path.exists(go):
            time.sleep(0.005)
        time.sleep(delay)
        try:
            ck.save(step, {"w": torch.full((64,), value), "v": torch.full((32,), -value)})
            print("committed", flush=True)
        except CheckpointExistsError:
            print("exists", flush=True)


if __name__ == "__main__":
    main()
