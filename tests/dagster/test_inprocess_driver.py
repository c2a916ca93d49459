"""The in-process driver's report (``pipelines.inprocess``): what the demo's "landed N
checkpoint partitions; M runs" line counts."""

import torch

from assets import checkpoint_key
from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from pipelines import demo
from pipelines.inprocess import QUIET, DriveReport, tick_landing
from support.corrupt import corrupt_chunk, only_in
from support.dagster import RUN


def test_a_step_committed_again_lands_in_its_partition_once_and_both_validations_are_runs(
    store_with_checkpoints, defs, instance
):
    """Restore rejects step 40, training falls back to 30 and commits step 40 again, while the
    driver runs. ``landed`` counted validation run requests: the second commit made it 5
    "checkpoint partitions" for 4 partitions, and the second validation run replaced the
    first one's entry in ``runs``. Each partition lands once; each run is its own entry."""
    keys = [checkpoint_key(RUN, s) for s in (10, 20, 30, 40)]
    report = DriveReport()
    cursor = tick_landing(defs, instance, None, report, QUIET)
    assert report.landed == keys and report.runs == {f"validate_checkpoint[{k}]": True for k in keys}

    corrupt_chunk(store_with_checkpoints, RUN, 40, only_in(store_with_checkpoints, RUN, 40, 30)[0])
    torch.manual_seed(1)
    state = demo.build()
    with Checkpointer(store_with_checkpoints, RUN) as ck:
        assert ck.restore(state).step == 30
        ck.save(40, state, metadata={"train_loss": 0.5})  # a second commit of step 40
    again = catalog.read_manifest(open_store(store_with_checkpoints), RUN, 40).digest
    tick_landing(defs, instance, cursor, report, QUIET)

    assert report.landed == keys  # the partitions commits landed in, each once
    assert report.runs == {
        **{f"validate_checkpoint[{k}]": True for k in keys},
        f"validate_checkpoint[{keys[3]}@{again[:16]}]": True,  # the second commit's own validation
    }
