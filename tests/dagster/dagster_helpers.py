"""Helpers for the Dagster-layer tests: real TinyLM checkpoints, corruption."""

import os

import torch

from ckptflow import Checkpointer
from ckptflow import format as fmt
from pipelines import demo

RUN = "tinylm"


def write_checkpoints(store: str, steps=(10, 20, 30, 40), run: str = RUN, full_every: int = 20) -> None:
    """Train the demo TinyLM and save at ``steps`` (full every ``full_every``)."""
    torch.manual_seed(0)
    state = demo.build()
    with Checkpointer(store, run) as ck:
        done = max((i.step for i in ck.list()), default=0)
        for step in range(done + 1, max(steps) + 1):
            loss = demo.train_step(state)
            if step in steps:
                ck.save(step, state, metadata={"train_loss": round(loss, 4)},
                        kind="full" if step % full_every == 0 else "incremental")


def corrupt_chunk(store: str, run: str, step: int) -> None:
    """Flip one byte of a chunk only ``step`` uses (its newest-written chunk)."""
    manifest = fmt.unseal(open(os.path.join(store, fmt.manifest_key(run, step)), "rb").read(), "m")
    digest = sorted(manifest["chunks"])[0]
    path = os.path.join(store, fmt.chunk_key(digest))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
