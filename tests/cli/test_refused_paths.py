"""What an error of the operating system's tells the user to fix (``cli.output.os_error_text``):
the store (its ROOT as the store resolves it: through ``~`` or a symbolic link), a directory
above a root to be created, export's --out (even inside the store), or another path; and a
read-only file system, which no permission fixes, told as such.

Run as root here, which permissions do not stop: a refused write is an immutable directory,
a read-only file system a read-only tmpfs (``support.refused``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptflow.cli.output import os_error_text
from support.cli import RUN, make_store, run_cli
from support.refused import read_only_tmpfs, unwritable


@pytest.fixture
def read_only_fs(tmp_path) -> Iterator[Path]:
    """An empty directory on a file system mounted read-only (a tmpfs)."""
    where = tmp_path / "read-only-fs"
    where.mkdir()
    with read_only_tmpfs(where):
        yield where


def source_file(tmp_path: Path) -> Path:
    src = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(src))
    return src


@pytest.mark.parametrize("named", ["symlink", "home"])
def test_a_store_named_through_a_link_or_home_is_the_store(tmp_path, monkeypatch, capsys, named):
    """``gc ~/store`` or ``gc LINK/store`` refused a write in the store was told 'this user
    may not access that path: give one it may use (export's --out, import's source)': the
    path was compared with the ROOT as typed, not as the store resolves it."""
    root, _, _ = make_store(tmp_path / "real")
    if named == "symlink":
        (tmp_path / "link").symlink_to(tmp_path / "real")
        given = str(tmp_path / "link" / "store")
    else:
        monkeypatch.setenv("HOME", str(tmp_path / "real"))
        given = "~/store"
    with unwritable(Path(root)):
        code, _, err = run_cli(capsys, "gc", given, "--grace", "1h")
    assert code == 2 and f"{root}/locks" in err, err
    assert "this command needs write access there" in err and "import's source" not in err, err


def test_a_root_to_be_created_below_a_directory_it_may_not_write_is_told_to_pick_another_root(tmp_path, capsys):
    """A new ROOT whose parent cannot be created was told to fix 'export's --out, import's
    source', neither of which was refused."""
    src = source_file(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    root = locked / "parent" / "store"
    with unwritable(locked):
        code, _, err = run_cli(capsys, "import", root, "--run", RUN, "--step", "1", src)
    assert code == 2 and not (locked / "parent").exists()
    assert f"{locked}/parent" in err and "give a ROOT it may create" in err, err
    assert "import's source" not in err, err


def test_an_export_out_inside_the_store_is_a_write_by_export(tmp_path, capsys):
    """An --out in a directory of the store export may not write was told 'export only reads
    the store: run it as a user who may read the store', which this user may."""
    root, _, _ = make_store(tmp_path)
    exports = Path(root) / "exports"
    exports.mkdir()
    with unwritable(exports):
        code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--out", exports / "m.safetensors")
    assert code == 2 and list(exports.iterdir()) == []
    assert "pass an --out it may write" in err and "only reads the store" not in err, err


def test_an_export_to_a_read_only_file_system_is_told_so_not_sent_to_fix_permissions(tmp_path, capsys, read_only_fs):
    root, _, _ = make_store(tmp_path)
    code, _, err = run_cli(capsys, "export", root, "--run", RUN, "--out", read_only_fs / "m.safetensors")
    assert code == 2 and "Read-only file system" in err, err
    assert "the file system is mounted read-only: pass an --out on a writable one" in err, err
    assert "permissions" not in err, err  # was "...: give one it may use (...), or fix its permissions"


def test_an_import_into_a_read_only_file_system_is_told_to_use_a_writable_one(tmp_path, capsys, read_only_fs):
    src = source_file(tmp_path)
    code, _, err = run_cli(capsys, "import", read_only_fs / "store", "--run", RUN, "--step", "1", src)
    assert code == 2 and "the file system is mounted read-only: use a store on a writable one" in err, err
    assert "a user who may write" not in err, err


@pytest.mark.parametrize(
    ("filename", "command", "told"),
    [
        ("/elsewhere/src.pt", "import", "mounted read-only: give a path on a writable one"),  # was "...permissions"
        ("{root}/chunks/ab", "ls", "mounted read-only: use a store on a writable one"),
        ("{parent}", "import", "mounted read-only: give a ROOT on a writable one"),
    ],
)
def test_erofs_is_told_before_any_access_advice(tmp_path, filename, command, told):
    root = tmp_path / "parent" / "store"
    error = OSError(errno.EROFS, os.strerror(errno.EROFS), filename.format(root=root, parent=root.parent))
    text = os_error_text(error, command=command, store=str(root))
    assert told in text and "permissions" not in text and "a user who may" not in text, text
