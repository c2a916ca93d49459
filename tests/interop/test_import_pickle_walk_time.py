"""The pickle walk's own time is bounded by the file's bytes, not by what its values hold.

The walk compared what a value is (its kind: a tuple's holds its first items' kinds) by
hashing it: a tuple holding the one before four times, 20 levels of memo reads (1.3 KB),
made the callable of a REDUCE or ``_rebuild_from_type_v2``'s first argument, was 4^20 kinds
to hash (14 levels took 4.4 s, 20 would take hours). And an int's kind hashes in time of
its size: a 1 MB int called 20,000 times (1.1 MB of ``.metadata``) took 12 s, 10,000 times
a dict key (in one SETITEMS) 9.4 s. Each runs in a process of its own, given 20 s where
the walk before took minutes to hours.
"""

from __future__ import annotations

import subprocess
import sys

from support.pickle_files import torch_file_with

_GET = b"h"  # BINGET
_PUT = b"q"  # BINPUT
_BIG_INT = b"\x8b" + (1 << 20).to_bytes(4, "little") + b"\x01" * (1 << 20)  # LONG4: an int of 1 MB

_IMPORT_IN_A_PROCESS = """
import sys
from ckptflow.errors import CkptflowError
from ckptflow.interop import importers
try:
    importers.import_checkpoint(sys.argv[1] + "/store", "r", 1, sys.argv[2])
except CkptflowError as e:
    print(e)
"""


def _nested_tuple(levels: int) -> bytes:
    """T0 = 1, T(i+1) = (Ti, Ti, Ti, Ti), memoized at i: 4^levels kinds behind the last."""
    built = b"K\x01" + _PUT + b"\x00"
    for i in range(levels):
        built += b"(" + (_GET + bytes([i])) * 4 + b"t" + _PUT + bytes([i + 1])
    return built


def _refusal(tmp_path, source) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_IN_A_PROCESS, str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "store" / "runs").exists()
    return done.stdout


def test_a_tuple_nesting_its_kind_4_20_times_called_is_refused_at_once(tmp_path):
    torch_file_with(tmp_path / "callable.pt", _nested_tuple(20) + b")R")
    assert "callable.pt calls a value that is not a named class or function" in _refusal(
        tmp_path, tmp_path / "callable.pt"
    )


def test_a_tuple_nesting_its_kind_4_20_times_given_to_rebuild_from_type_is_refused_at_once(tmp_path):
    rebuild = b"ctorch._tensor\n_rebuild_from_type_v2\n(" + _GET + bytes([20]) + b"tR"
    torch_file_with(tmp_path / "rebuild.pt", _nested_tuple(20) + rebuild)
    assert "rebuild.pt calls torch._tensor._rebuild_from_type_v2 (given what torch.save never gives it)" in (
        _refusal(tmp_path, tmp_path / "rebuild.pt")
    )


def test_dcp_metadata_calling_an_int_of_1_mb_many_times_is_refused_at_once(tmp_path):
    (tmp_path / "dcp").mkdir()
    calls = _GET + b"\x00)R0"  # the int, called with nothing, its result popped
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x02" + _BIG_INT + _PUT + b"\x00" + calls * 100_000 + b"N.")
    assert "is not readable DCP metadata (TypeError: 'int' object is not callable)" in _refusal(
        tmp_path, tmp_path / "dcp"
    )


def test_dcp_metadata_keying_a_dict_by_an_int_of_1_mb_many_times_is_refused_at_once(tmp_path):
    (tmp_path / "dcp").mkdir()
    keys = (_GET + b"\x00N") * 100_000  # the int as a key, None its value
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x02}" + _BIG_INT + _PUT + b"\x00(" + keys + b"u.")
    assert "keys dicts or sets by more than 1024 ints of 2^61 - 1 or more" in _refusal(tmp_path, tmp_path / "dcp")
