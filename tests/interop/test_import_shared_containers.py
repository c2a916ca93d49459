"""A list, dict or object referenced many times is counted with all it holds each time.

A pickler memoizes a container before it fills it, and the walk's memo kept the value as
it was then, empty: a memo read of a filled list weighed 1. So 40 lists each holding the
one before twice (``l = [l, l]``, a 1.7 KB torch.save file) were counted as 40 values,
while the import's walk of the state visits 2^40 (10 s at 22 levels, days at 40). The memo
now holds what the container holds once filled; and a container filled after a memo read
referenced it (the walk would have counted that reference empty) is refused.
"""

from __future__ import annotations

import struct

import pytest
import torch

from ckptflow.errors import CkptflowError, DcpFormatError
from ckptflow.interop import dcp_metadata_file, importers, torch_files
from support.pickle_files import torch_file_with

LIMIT = 1000


def _refused(path, match: str) -> None:
    with pytest.raises(CkptflowError, match=match):
        importers.import_checkpoint(str(path.parent / "store"), "r", 1, path)
    assert not (path.parent / "store" / "runs").exists()


def _doubling(levels: int, *, as_dict: bool) -> object:
    value: object = [0]
    for _ in range(levels):
        value = {"a": value, "b": value} if as_dict else [value, value]
    return value


@pytest.mark.parametrize("as_dict", [False, True], ids=["lists", "dicts"])
def test_containers_each_holding_the_one_before_twice_are_counted_as_often(tmp_path, monkeypatch, as_dict):
    monkeypatch.setattr(torch_files, "MAX_VISITS", LIMIT)
    torch.save({"w": torch.ones(2), "junk": _doubling(10, as_dict=as_dict)}, tmp_path / "shared.pt")
    _refused(tmp_path / "shared.pt", f"shared.pt builds values holding more than {LIMIT} objects counted with all")


def test_shared_containers_within_the_bound_import(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_files, "MAX_VISITS", 10 * LIMIT)
    state = {"w": torch.ones(2), "junk": _doubling(6, as_dict=False), "groups": _doubling(6, as_dict=True)}
    torch.save(state, tmp_path / "shared.pt")
    assert importers.read_source(tmp_path / "shared.pt").state["junk"] == state["junk"]


def _get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)  # LONG_BINGET


# [L, [L] * 1000, L] with L = [], then L filled with 1000 ints: the middle list holds a million
_FILLED_AFTER_READ = (
    b"](" + b"]r" + struct.pack("<I", 9000) + b"](" + _get(9000) * LIMIT + b"e" + _get(9000) + b"(" + b"K\x01" * LIMIT
) + b"ee"


def test_a_list_filled_after_a_memo_read_referenced_it_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_files, "MAX_VISITS", 100 * LIMIT)
    torch_file_with(tmp_path / "refilled.pt", _FILLED_AFTER_READ)
    junk = torch.load(tmp_path / "refilled.pt", weights_only=True)["junk"]
    assert sum(len(inner) for inner in junk[1]) == LIMIT * LIMIT  # what readers would walk
    _refused(tmp_path / "refilled.pt", "refilled.pt fills a list, dict or object after a memo read referenced it")


def test_dcp_metadata_filling_a_list_after_a_memo_read_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + _FILLED_AFTER_READ + b".")
    with pytest.raises(DcpFormatError, match=r"\.metadata fills a list, dict or object after a memo read"):
        dcp_metadata_file.read_metadata(str(tmp_path))
