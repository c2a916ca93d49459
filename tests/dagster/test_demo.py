"""The demo is the project's front door: it must run and tell the truth."""

import re

import pytest

from pipelines.demo.cli import main


@pytest.mark.slow  # the whole demo in-process (trains, crashes, restores, drives the lifecycle): make test-e2e
def test_demo_trains_crashes_restores_and_skips_the_corrupt_checkpoint(tmp_path, capsys):
    """The demo without its last part (the real daemon: tests/dagster/test_daemon.py and the
    browser test run that)."""
    from dagster import AssetKey, DagsterInstance

    store = tmp_path / "store"
    assert main(["--store", str(store), "--steps", "60", "--crash-at", "35", "--no-daemon"]) == 0
    out = capsys.readouterr().out
    assert "restored step 30 (data position 30" in out
    assert "verify step 60: CORRUPT" in out
    assert "restore picked step 50; skipped:\n    step 60: " in out
    assert "best 1 of 5 by min val_loss (" in out  # retention reasons whole, not cut at a column
    assert re.search(r"step 60: chunk\s+file://\S+/chunks/[0-9a-f]{2}/[0-9a-f]{64}\s+does not match", out), out  # whole
    assert "6 checkpoints" in out
    assert re.search(r"== checkpoint interval \(ckptflow advise .* --scenario preemptible\): every \d+ steps", out)
    assert "the demo's every 10 steps loses" in out
    # the Dagster lifecycle half: the corrupt checkpoint is blocked by its check, the rest flow through
    assert "landed 6 checkpoint partitions" in out
    assert "1 failed: ['validate_checkpoint[tinylm-demo@60]']" in out
    assert "step 60 blocked by the integrity check" in out
    assert "== model tinylm:stable -> v1 from tinylm-demo@" in out
    assert (tmp_path / "store-archive" / "runs" / "tinylm-demo").is_dir()
    assert "RPO freshness check: passed" in out
    # `make ui` right after the demo shows the views it computed, and the blocked run's failure
    with DagsterInstance.from_config(str(tmp_path / "store-dagster_home")) as instance:
        for view in ("checkpoint_inventory", "retention_plan", "recovery_metrics"):
            assert instance.get_latest_materialization_event(AssetKey(view)) is not None, view
        inventory = instance.get_latest_materialization_event(AssetKey("checkpoint_inventory"))
        table = inventory.asset_materialization.metadata["table"].value
        assert "checkpoint: integrity check blocked" in table  # its last failure, recorded by failure_sensor
