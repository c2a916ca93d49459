"""What the CLI shows a person: ``ls`` metrics rounded, one message for a step a run does not
have (verify and export alike)."""

from __future__ import annotations

from ckptflow import Checkpointer
from ckptflow.reports.units import rounded
from support.cli import RUN, run_cli
from support.states import tiny_state


def test_ls_prints_metrics_rounded(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, tiny_state(), metadata={"loss": 9.34805965423584, "tokens": 123456789, "tag": "a"})
    code, out, _ = run_cli(capsys, "ls", root)
    assert code == 0
    assert '"loss":9.348' in out and "9.34805965423584" not in out and '"tokens":123456789' in out


def test_one_message_for_a_missing_step(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(10, tiny_state())
    messages = []
    for argv in (["verify", root, "--run", RUN, "--step", "115"], ["export", root, "--run", RUN, "--out",
                 str(tmp_path / "m.safetensors"), "--step", "115"]):  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 2
        messages.append(err.strip())
    assert messages[0] == messages[1] == "ckptflow: error: run 'alpha' has no step 115 (steps: 10)"


def test_rounded_keeps_structure():
    assert rounded({"a": [0.123456, 2], "b": "x", "c": float("nan")})["a"] == [0.1235, 2]
