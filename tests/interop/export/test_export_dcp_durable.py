"""A DCP export is durable before it is reported done: every file of the directory
(DCP's data files and ``.metadata``, and ckptflow's ``ckptflow.json`` sidecar) is
fsynced, then the directory itself, before it is renamed into place, and the parent
after the rename, as the safetensors export does (``DISK.write_new``, ``fsync_dir``).
The sidecar used to be written with a plain ``open``/``write`` and no directory was
fsynced: a crash after ``export_dcp`` returned could leave the export without its
sidecar (or with it empty) or without its name."""

from __future__ import annotations

import os

from ckptflow import Checkpointer
from ckptflow.interop.export import export_dcp
from ckptflow.interop.export.dcp import SIDECAR
from support.states import tiny_state


def test_every_file_and_directory_of_a_dcp_export_is_fsynced_before_it_is_done(tmp_path, monkeypatch):
    root, out = str(tmp_path / "store"), str(tmp_path / "exports" / "dcp")
    os.mkdir(tmp_path / "exports")
    with Checkpointer(root, run="r") as ck:
        ck.save(1, tiny_state(), metadata={"loss": 0.5})

    synced: list[tuple[int, bool, bool]] = []  # (inode, a directory?, ``out`` there yet?) per fsync, in order
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        real_fsync(fd)
        st = os.fstat(fd)
        synced.append((st.st_ino, os.path.isdir(f"/proc/self/fd/{fd}"), os.path.exists(out)))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    result = export_dcp(root, "r", out)
    monkeypatch.undo()

    files = sorted(os.listdir(out))
    assert SIDECAR in files and ".metadata" in files and any(f.endswith(".distcp") for f in files)
    assert set(result.files) == set(files)
    order = {ino: i for i, (ino, _, _) in reversed(list(enumerate(synced)))}  # first fsync of each inode
    unsynced = [f for f in files if os.stat(os.path.join(out, f)).st_ino not in order]
    assert not unsynced, f"files of the export never fsynced: {unsynced}"
    last_file = max(order[os.stat(os.path.join(out, f)).st_ino] for f in files)

    directory = os.stat(out).st_ino  # the same inode under its temporary name
    before_rename = [i for i, (ino, is_dir, there) in enumerate(synced) if ino == directory and is_dir and not there]
    assert before_rename and before_rename[-1] > last_file, "the directory was not fsynced after its files"
    parent = os.stat(tmp_path / "exports").st_ino
    assert any(ino == parent and is_dir and there for ino, is_dir, there in synced), (
        "the parent directory was not fsynced after the rename"
    )
