"""The demo's recovery part: the newest checkpoint corrupted, restore recovers to the newest
validated one, passing over the failed and the unvalidated, and the two resumes print."""

from __future__ import annotations

import pytest

from pipelines.demo.recover import recover_demo


@pytest.mark.slow  # the demo's recovery part, training included: make test-e2e
def test_the_demo_recovers_to_validated_and_shows_both_resumes(tmp_path, capsys):
    shown = recover_demo(str(tmp_path / "store"), steps=40, every=10, after=6)
    out = capsys.readouterr().out
    assert shown["validated"] == 20  # 40 corrupted (failed validation), 30 not validated yet
    assert [s for s, _ in shown["passed_over"]] == [40, 30]
    assert "restore(select='validated') -> step 20" in out
    assert len(shown["plain"]) == len(shown["warmed"]) == 6
    assert shown["plain"][0] != shown["warmed"][0] or shown["plain"][1] != shown["warmed"][1]  # the LR differs
    assert "loss without | with a warm-up" in out
