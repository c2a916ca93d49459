"""Runs for the selector tests: checkpoints of ``model_at(step)`` under run "r", a step's
chunk damaged, a validated step committed again."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ckptflow import Checkpointer, lifecycle
from ckptflow.store import open_store
from support.corrupt import chunk_path, flip_byte, only_in
from support.states import model_at


def make(tmp_path, steps: Iterable[int], val_loss: Callable[[int], float | None] = lambda step: 1.0 / step):
    """Run "r" with a checkpoint at each of ``steps``, its trainer's ``val_loss`` in its
    metadata (None: the step records none)."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "r", chunk_bytes=256) as ck:
        for step in steps:
            loss = val_loss(step)
            ck.save(step, {"model": model_at(step)}, metadata={} if loss is None else {"val_loss": loss})
    return root, open_store(root)


def damage(root, step: int) -> None:
    flip_byte(chunk_path(root, only_in(root, "r", step)[0]))


def step_2_validated_then_committed_again(tmp_path, **metadata):
    """Steps 1 and 2 validated; step 2 then damaged, restored past and saved anew (a new
    commit, never validated) with ``metadata``."""
    root, store = make(tmp_path, steps=(1, 2))
    for step in (1, 2):
        lifecycle.validate(store, "r", step)
    with Checkpointer(root, "r") as ck:
        damage(root, 2)
        ck.restore({"model": model_at(0)})
        ck.save(2, {"model": model_at(2)}, metadata=metadata)
    return root, store
