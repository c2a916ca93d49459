"""The demo is the project's front door: it must run and tell the truth."""

from pipelines.demo.cli import main


def test_demo_trains_crashes_restores_and_skips_the_corrupt_checkpoint(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["--store", str(store), "--steps", "60", "--crash-at", "35"]) == 0
    out = capsys.readouterr().out
    assert "restored step 30 (data position 30" in out
    assert "verify step 60: CORRUPT" in out
    assert "restore picked step 50; skipped [(60," in out
    assert "6 checkpoints" in out
    # the Dagster lifecycle half: the corrupt checkpoint is blocked by its check, the rest flow through
    assert "landed 6 checkpoint partitions" in out
    assert "1 failed: ['validate_checkpoint[tinylm-demo__step-000000000060]']" in out
    assert "step 60 blocked by the integrity check" in out
    assert "== model tinylm:stable -> v1 from tinylm-demo__step-0000000000" in out
    assert (tmp_path / "store-archive" / "runs" / "tinylm-demo").is_dir()
