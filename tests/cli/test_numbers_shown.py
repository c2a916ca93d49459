"""What the CLI shows a person: ``ls`` metrics rounded and the bytes each save added as
stored, one message for a step a run does not have (verify and export alike)."""

from __future__ import annotations

import json

import torch

from ckptflow import Checkpointer, SavePolicy
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format.sealed import seal, unseal
from ckptflow.reports.units import human_bytes, rounded
from ckptflow.store import open_store
from support.cli import RUN, run_cli
from support.states import tiny_state


def test_ls_prints_metrics_rounded(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(1, tiny_state(), metadata={"loss": 9.34805965423584, "tokens": 123456789, "tag": "a"})
    code, out, _ = run_cli(capsys, "ls", root)
    assert code == 0
    assert '"loss":9.348' in out and "9.34805965423584" not in out and '"tokens":123456789' in out


def _zstd_run(root: str) -> None:
    """A full then an incremental save in which one of two compressible 1 MiB tensors changed."""
    state = {"a": torch.arange(1 << 18, dtype=torch.float32), "b": torch.zeros(1 << 18)}
    with Checkpointer(root, RUN, codec="zstd", policy=SavePolicy(full_every=10, incremental_every=1)) as ck:
        ck.save(1, state)
        state["b"] += 1
        ck.save(2, state)


def _written_column(out: str) -> dict[int, str]:
    """``ls``'s WRITTEN column by step (right-aligned under its header: the number and its unit)."""
    lines = out.splitlines()
    end = lines[0].index("WRITTEN") + len("WRITTEN")
    return {int(line.split()[1]): " ".join(line[:end].split()[-2:]) for line in lines[1:]}


def test_ls_shows_the_bytes_each_save_added_as_stored_not_before_encoding(tmp_path, capsys):
    root = str(tmp_path / "store")
    _zstd_run(root)
    code, out, _ = run_cli(capsys, "ls", root, "--json")
    assert code == 0
    infos = {i["step"]: i for i in json.loads(out)}
    for step in (1, 2):
        manifest = catalog.read_manifest(open_store(root), RUN, step)
        assert infos[step]["added_bytes"] == manifest.stats.stored_written < manifest.stats.bytes_written
    assert infos[2]["added_bytes"] < infos[1]["added_bytes"] / 2  # one of two tensors, compressed
    code, out, _ = run_cli(capsys, "ls", root)
    assert _written_column(out) == {step: human_bytes(infos[step]["added_bytes"]) for step in (1, 2)}


def test_an_index_an_older_ckptflow_wrote_is_rebuilt_not_shown_with_fields_missing(tmp_path, capsys):
    """An index of summaries without ``added_bytes`` (written before it was kept) showed 0 B
    for every checkpoint whose manifest did not change, that is, for good."""
    root = str(tmp_path / "store")
    _zstd_run(root)
    run_cli(capsys, "ls", root)
    index = tmp_path / "store" / "index" / "runs" / f"{RUN}.json"
    doc = unseal(index.read_bytes(), "index")
    del doc["schema"]
    doc["index_version"] = 2  # as that version wrote it
    for entry in doc["entries"].values():
        del entry[3]["added_bytes"]
    index.write_bytes(seal(doc))
    code, out, _ = run_cli(capsys, "ls", root, "--json")
    assert code == 0
    assert all(i["added_bytes"] > 0 for i in json.loads(out))
    assert unseal(index.read_bytes(), "index")["schema"] == catalog.SUMMARY_SCHEMA


def test_one_message_for_a_missing_step(tmp_path, capsys):
    root = str(tmp_path / "store")
    with Checkpointer(root, RUN) as ck:
        ck.save(10, tiny_state())
    messages = []
    for argv in (["verify", root, "--run", RUN, "--step", "115"], ["export", root, "--run", RUN, "--out",
                 str(tmp_path / "m.safetensors"), "--step", "115"],
                 ["ls", root, "--run", RUN, "--select", "115"]):  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 2
        messages.append(err.strip())
    assert messages == ["ckptflow: error: run 'alpha' has no step 115 (steps: 10)"] * 3


def test_rounded_keeps_structure():
    assert rounded({"a": [0.123456, 2], "b": "x", "c": float("nan")})["a"] == [0.1235, 2]
