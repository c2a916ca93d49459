"""Child process for chunks/test_leases.py: a real save that holds its GC lease, stopped mid-way.

usage: lease_holder.py STORE RUN

Saves step 1 (a full save) through a store whose chunk writes block, prints "holding"
once the save holds its lease and is writing chunks, and waits there to be killed.
"""

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for support.*

from ckptflow import Checkpointer, open_store
from support.faulty_store import FaultyStore


def main() -> None:
    root, run = sys.argv[1], sys.argv[2]
    store = FaultyStore(open_store(root))
    writing = store.pause_before("replace", lambda key: key.startswith("chunks/"), timeout=600)

    def say_when_writing() -> None:
        writing.reached.wait()
        print("holding", flush=True)

    threading.Thread(target=say_when_writing, daemon=True).start()
    with Checkpointer(store, run, threads=1) as ck:
        ck.save(1, {"w": torch.ones(1024)})


if __name__ == "__main__":
    main()
