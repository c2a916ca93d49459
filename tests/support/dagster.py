"""The Dagster-layer tests' store: real TinyLM checkpoints of the demo model."""

import torch

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import Store, open_store
from pipelines import demo

RUN = "tinylm"
EVALUATORS = {RUN: "pipelines.demo.evaluate:evaluate"}  # the tests' run holds the demo's model


def subject(store: Store | str, step: int, run: str = RUN) -> lifecycle.Subject:
    """The current commit of ``(run, step)``: what its lifecycle records are keyed by."""
    return lifecycle.Subject.of(catalog.read_manifest(open_store(store), run, step))


def record(store: Store | str, step: int, what: str, run: str = RUN) -> dict | None:
    """The ``what`` record of the current commit of ``(run, step)``."""
    return lifecycle.read_record(open_store(store), subject(store, step, run), what)


def write_checkpoints(store: str, steps=(10, 20, 30, 40), run: str = RUN, full_every: int = 20) -> None:
    """Train the demo TinyLM and save at ``steps`` (full every ``full_every``)."""
    torch.manual_seed(0)
    state = demo.build()
    with Checkpointer(store, run) as ck:
        done = max((i.step for i in ck.list()), default=0)
        for step in range(done + 1, max(steps) + 1):
            loss = demo.train_step(state)
            if step in steps:
                ck.save(
                    step,
                    state,
                    metadata={"train_loss": round(loss, 4)},
                    kind="full" if step % full_every == 0 else "incremental",
                )


def scrub_all(defs, instance, *, raise_on_error: bool = True):
    """One run of ``scrub_job`` over every checkpoint, whatever its age."""
    config = {"ops": {"scrub_checkpoints": {"config": {"older_than_days": 0}}}}
    return defs.resolve_job_def("scrub_job").execute_in_process(
        instance=instance, run_config=config, raise_on_error=raise_on_error
    )
