"""The demo is the project's front door: it must run and tell the truth."""

from pipelines import demo


def test_demo_trains_crashes_restores_and_skips_the_corrupt_checkpoint(tmp_path, capsys):
    store = tmp_path / "store"
    assert demo.main(["--store", str(store), "--steps", "60", "--crash-at", "35"]) == 0
    out = capsys.readouterr().out
    assert "restored step 30 (data position 30" in out
    assert "verify step 60: CORRUPT" in out
    assert "restore picked step 50; skipped [(60," in out
    assert "6 checkpoints" in out
