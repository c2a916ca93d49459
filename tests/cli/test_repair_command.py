"""`ckptflow repair ROOT --from URL`: damaged chunk objects replaced from another tier."""

import contextlib
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.io import ChunkStore
from ckptflow.cli import commands
from ckptflow.errors import CorruptChunkError
from ckptflow.format.layout import READABLE_FORMATS, chunk_key
from ckptflow.lifecycle import archive
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import flip_byte, reseal_manifest


def test_repair_from_the_archive_then_nothing_left_and_without_a_copy_exit_1(tmp_path, capsys):
    hot_root, archive_root = str(tmp_path / "hot"), str(tmp_path / "archive")
    hot, cold = open_store(hot_root), open_store(archive_root)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": {"w": torch.randn(128, 128)}}, rng=False)
        ck.save(2, {"model": {"w": torch.randn(128, 128)}}, rng=False)
    assert archive(hot, cold, "r", 1).ok
    for step in (1, 2):
        digest, size = next(iter(catalog.read_manifest(hot, "r", step).chunks.items()))
        flip_byte(Path(hot_root) / chunk_key(digest), 10)
        with pytest.raises(CorruptChunkError):
            ChunkStore(hot).get(digest, size)  # a reader refuses it: recorded

    code, out, _ = run_cli(capsys, "repair", hot_root, "--from", archive_root)
    assert code == 1
    assert out.count("repaired chunk") == 1 and out.count("not repaired: chunk") == 1  # step 2 was never archived
    assert Checkpointer(hot, "r").verify(1).ok and not Checkpointer(hot, "r").verify(2).ok

    code, out, _ = run_cli(capsys, "repair", archive_root, "--from", hot_root)
    assert code == 0 and "no damaged chunk objects recorded" in out


def test_a_record_only_a_newer_format_checkpoint_may_list_exits_3_and_says_to_repair_again(tmp_path, capsys):
    root = str(tmp_path / "hot")
    store = open_store(root)
    with Checkpointer(store, "r") as ck:
        ck.save(1, {"model": {"w": torch.randn(128, 128)}}, rng=False)
    digest, size = next(iter(catalog.read_manifest(store, "r", 1).chunks.items()))
    flip_byte(Path(root) / chunk_key(digest), 10)
    with pytest.raises(CorruptChunkError):
        ChunkStore(store).get(digest, size)
    reseal_manifest(root, "r", 1, lambda record: record.update(format_version=max(READABLE_FORMATS) + 1))

    with Checkpointer(str(tmp_path / "other"), "o") as ck:  # a tier with no copy of it
        ck.save(1, {"w": torch.zeros(4)}, rng=False)
    code, out, err = run_cli(capsys, "repair", root, "--from", str(tmp_path / "other"))
    assert code == 3 and "newer ckptflow" in err
    assert "not repaired yet: 1 damage record(s) of chunks no checkpoint read lists" in out and "gc" not in out


def test_repair_shows_a_progress_bar_of_the_bytes_it_repairs(tmp_path, capsys, monkeypatch):
    hot_root, archive_root = str(tmp_path / "hot"), str(tmp_path / "archive")
    hot, cold = open_store(hot_root), open_store(archive_root)
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": {"w": torch.randn(128, 128)}}, rng=False)
    assert archive(hot, cold, "r", 1).ok
    digest, size = next(iter(catalog.read_manifest(hot, "r", 1).chunks.items()))
    flip_byte(Path(hot_root) / chunk_key(digest), 10)
    with pytest.raises(CorruptChunkError):
        ChunkStore(hot).get(digest, size)
    bars: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def bar(desc, total=None):  # what an interactive stderr would show: a bar per description
        yield bars.setdefault(desc, []).append

    monkeypatch.setattr(commands, "progress", bar)
    code, out, _ = run_cli(capsys, "repair", hot_root, "--from", archive_root)
    assert code == 0 and out.count("repaired chunk") == 1
    assert bars == {f"repair {hot.url}": [size]}
