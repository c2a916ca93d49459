"""A Checkpointer used in a child forked from its process (``ckptflow.training.forks``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.child_env import child_env

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys, time, torch
torch.set_num_threads(1)  # GNU OpenMP's pool, once used, hangs a forked child's torch ops: not ours to test
from ckptflow import Checkpointer
from ckptflow.chunks.io import ChunkStore
put = ChunkStore.put
ChunkStore.put = lambda self, *a, **k: (time.sleep(0.5), put(self, *a, **k))[1]  # a slow store
with Checkpointer({root!r}, "run", chunk_bytes=1 << 18) as ck:
    ck.save(1, {{"w": torch.ones(1 << 18)}})  # the pool's threads have started
    handle = ck.save(2, {{"w": torch.full((1 << 18,), 2.0)}}, blocking=False)
    pid = os.fork()
    if pid == 0:
        try:
            state = {{"w": torch.zeros(1 << 18)}}
            step = ck.restore(state).step
            assert step in (1, 2) and torch.equal(state["w"], torch.full((1 << 18,), float(step)))
            ck.close()  # as leaving the with block in the child does
            os._exit(0)
        except BaseException as e:
            print("child failed:", repr(e), file=sys.stderr, flush=True)
            os._exit(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
        time.sleep(0.1)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
            sys.exit("the child hung")
    handle.wait()
print([info.step for info in Checkpointer({root!r}, "run").list()])
"""


def test_a_forked_child_restores_and_closes_with_the_inherited_checkpointer(tmp_path):
    """Before: the child's restore waited for ever on threads only the parent has, and its
    ``close()`` on the parent's async save in flight, which no thread of the child finishes."""
    script = SCRIPT.format(root=str(tmp_path / "store"))
    done = subprocess.run(
        [sys.executable, "-c", script], env=child_env(TESTS.parent), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[1, 2]"  # the parent's save committed, once
