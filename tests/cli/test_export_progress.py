"""``ckptflow export``'s progress bar on a terminal: without --step it counted the verification
of the whole checkpoint (every chunk) and then the export's reads in one bar, 6736 bytes for
a 1680-byte export here; the verification has a bar of its own and the export's counts the
bytes it writes.

The bars are tqdm's, on a stderr that says it is a terminal; each one's count is kept when
it closes (``leave=False`` erases it from the screen)."""

from __future__ import annotations

import sys

import pytest
import tqdm
from safetensors.torch import load_file

from ckptflow.catalog import checkpoints as catalog
from ckptflow.store import open_store
from support.cli import RUN, make_store, run_cli


@pytest.fixture
def bars(monkeypatch):
    """The count of every progress bar shown, by its description, once it closed."""
    counts: dict[str, int] = {}

    class Kept(tqdm.tqdm):
        def close(self) -> None:
            counts[str(self.desc)] = self.n
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Kept)
    return counts


@pytest.mark.parametrize("step", [None, 20])
def test_the_export_bar_counts_the_bytes_written_once(tmp_path, capsys, monkeypatch, bars, step):
    root, _, _ = make_store(tmp_path)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the stderr the command prints to
    out = tmp_path / "m.safetensors"
    args = ["export", root, "--run", RUN, "--out", out] + ([] if step is None else ["--step", step])
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    written = sum(t.numel() * t.element_size() for t in load_file(str(out)).values())
    assert bars[f"export {RUN}"] == written  # was 6736 = 5056 (every chunk, verified) + 1680 without --step
    if step is None:  # the newest step that verifies: every chunk of step 20 read once, in a bar of its own
        assert bars[f"verify {RUN}"] == sum(catalog.read_manifest(open_store(root), RUN, 20).chunks.values())
    else:
        assert f"verify {RUN}" not in bars
