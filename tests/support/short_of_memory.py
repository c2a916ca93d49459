"""Child process for training/test_restore_memory.py: restore, or save a step already
committed, with too little address space left (RLIMIT_AS) to decode a 32 MiB zstd chunk
that the manifest declares, so the allocation is legitimate and fails for want of memory.

``python short_of_memory.py ROOT restore|save`` prints one JSON line: the error raised
(type and message) or the step restored. ROOT holds run "r": step 1 in 4 MiB chunks, step 2
in 32 MiB chunks, both sound (``make``)."""

from __future__ import annotations

import gc
import json
import logging
import resource
import sys
import threading

import torch

from ckptflow import Checkpointer


def make(root: str) -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(16 << 20)}  # 64 MiB
    with Checkpointer(root, "r", codec="zstd", chunk_bytes=4 << 20) as ck:
        ck.save(1, state)
    state["w"].add_(1)
    with Checkpointer(root, "r", codec="zstd", chunk_bytes=32 << 20) as ck:
        ck.save(2, state)


def main(root: str, what: str) -> None:
    logging.disable(logging.WARNING)
    live = {"w": torch.zeros(16 << 20)}
    threading.stack_size(256 << 10)
    ck = Checkpointer(root, "r", threads=2, track_writes=False)
    ck.restore(live, step=1)  # imports, pools and buffers, before the limit
    ck.verify(1, deep=False)
    gc.collect()
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
    try:
        outcome = {"step": ck.restore(live).step} if what == "restore" else {"saved": ck.save(2, live).step}
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(json.dumps(outcome))


if __name__ == "__main__":
    make(sys.argv[1]) if sys.argv[2] == "make" else main(sys.argv[1], sys.argv[2])
