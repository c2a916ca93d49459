"""What a pickle's values hold, and what its calls do, is bounded before anything unpickles it.

The walk counted opcodes, so a value counted once however often it was referenced: 40
tuples each holding the one before twice (1.5 KB) hung torch.load hashing one dict key, and
as a value the import's own walk of the state; the same in DCP's ``.metadata`` (450 bytes)
hung its unpickler. Numbers beyond 32 bits as dict keys can share one hash: 20,000 took
torch.load 2 s, a million would take hours. And ``torch.load(weights_only=True)`` runs
calls torch.save never writes: ``torch.FloatTensor(2**28)`` in a 1 KB file imported 1 GB of
uninitialised memory, ``bytearray(3 << 30)`` took 3.4 GB. Bounds lowered where a real one
would take minutes.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from ckptflow.errors import CkptflowError, DcpFormatError
from ckptflow.interop import dcp_metadata_file, importers, pickle_walk, torch_files
from support.pickle_files import torch_file_with

LIMIT = 1000


def _doubling_tuples(levels: int) -> bytes:
    """T0 = (), T(i+1) = (Ti, Ti): a memo write and read per level, 2^levels tuples in all."""
    built = b")"
    for i in range(levels):
        built += b"r" + struct.pack("<I", 9000 + i) + b"j" + struct.pack("<I", 9000 + i) + b"\x86"
    return built


def _refused(path, match: str) -> None:
    with pytest.raises(CkptflowError, match=match):
        importers.import_checkpoint(str(path.parent / "store"), "r", 1, path)
    assert not (path.parent / "store" / "runs").exists()


@pytest.mark.parametrize("as_key", [True, False], ids=["a dict key, hashed", "a value, walked"])
def test_a_value_holding_one_value_many_times_is_counted_as_often(tmp_path, monkeypatch, as_key):
    monkeypatch.setattr(torch_files, "MAX_VISITS", LIMIT, raising=False)
    junk = b"}" + _doubling_tuples(10) + b"Ns" if as_key else _doubling_tuples(10)
    torch_file_with(tmp_path / "tuples.pt", junk)
    loaded = torch.load(tmp_path / "tuples.pt", weights_only=True)["junk"]
    assert len(next(iter(loaded)) if as_key else loaded) == 2  # 2^10 tuples behind 10 memo reads
    _refused(tmp_path / "tuples.pt", "tuples.pt builds values holding more than 1000 objects counted with all")


def test_dcp_metadata_holding_one_value_many_times_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_metadata_file, "MAX_METADATA_VISITS", LIMIT, raising=False)
    (tmp_path / ".metadata").write_bytes(b"\x80\x02}" + _doubling_tuples(10) + b"Ns.")
    with pytest.raises(DcpFormatError, match=r"\.metadata builds values holding more than 1000 objects counted"):
        dcp_metadata_file.read_metadata(str(tmp_path))


def test_dict_keys_whose_hashes_can_collide_are_bounded(tmp_path):
    """Ints equal modulo 2^61 - 1 share a hash; real checkpoints key by names and small ints."""
    modulus = (1 << 61) - 1

    def keys(count: int) -> bytes:
        ints = (1 + i * modulus for i in range(1, count + 1))
        return b"}(" + b"".join(b"\x8a\x09" + n.to_bytes(9, "little") + b"N" for n in ints) + b"u"

    torch_file_with(tmp_path / "fits.pt", keys(pickle_walk.MAX_COLLIDABLE_KEYS))
    torch_file_with(tmp_path / "collide.pt", keys(pickle_walk.MAX_COLLIDABLE_KEYS + 1))
    assert len(importers.read_source(tmp_path / "fits.pt").state["junk"]) == pickle_walk.MAX_COLLIDABLE_KEYS
    _refused(
        tmp_path / "collide.pt",
        f"keys dicts or sets by more than {pickle_walk.MAX_COLLIDABLE_KEYS} ints of 2\\^61 - 1 or more",
    )


_STORAGE = object()  # pickled as the persistent id of storage "0"


class _Call:
    """Pickles as ``function(*args)``."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _hand_pickled(path, value) -> None:
    """{"w": value} as torch.save's zip, ``value`` pickled as written, storage "0" the 4 floats stored."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=2)
    pickler.persistent_id = lambda obj: ("storage", torch.FloatStorage, "0", "cpu", 4) if obj is _STORAGE else None
    pickler.dump({"w": value})
    torch_file_with(path, b"N")  # the zip's other entries
    with zipfile.ZipFile(path) as source:
        entries = {name: source.read(name) for name in source.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries.items():
            archive.writestr(name, out.getvalue() if name.endswith("/data.pkl") else data)


def _stride0_view(count: int) -> _Call:
    return _Call(torch._utils._rebuild_tensor_v2, _STORAGE, 0, (count,), (0,), False, collections.OrderedDict())


@pytest.mark.parametrize(
    "value, called",
    [
        (_Call(torch.FloatTensor, 1 << 20), "torch.FloatTensor"),
        (_Call(torch.Tensor, 1 << 20), "torch.Tensor"),
        (_Call(bytearray, 1 << 22), r"builtins.bytearray \(given what torch.save never gives it\)"),
        (_Call(torch._tensor._rebuild_from_type_v2, torch.FloatTensor, torch.Tensor, (1 << 20,), {}),
         r"torch._tensor._rebuild_from_type_v2 \(given what torch.save never gives it\)"),
        (_Call(torch._utils._rebuild_device_tensor_from_cpu_tensor, _stride0_view(1 << 20), torch.float64, "cpu",
               False), "torch._utils._rebuild_device_tensor_from_cpu_tensor"),
    ],
    ids=["tensor class", "torch.Tensor", "bytearray", "rebuild_from_type", "dtype conversion"],
)  # fmt: skip
def test_calls_torch_save_never_writes_are_refused_before_torch_load_runs_them(tmp_path, value, called):
    path = tmp_path / "calls.pt"
    _hand_pickled(path, value)
    made = torch.load(path, weights_only=True)["w"]  # what torch.load would make: 4 MB from no bytes of the file
    assert len(made) >= 1 << 20 and path.stat().st_size < 4096
    _refused(path, f"calls.pt calls {called} in its pickle, which torch.save writes for no tensor or plain value")


def test_torch_save_files_of_tensors_and_plain_values_import(tmp_path, monkeypatch):
    """Every call torch.save writes for a CPU tensor (with Python attributes, of a new dtype, a
    parameter) and plain value passes, and its values within ``VISITS_PER_TENSOR``."""
    weight = torch.arange(6.0).reshape(2, 3)
    parameter, tensor = torch.nn.Parameter(torch.ones(2)), torch.zeros(3)
    parameter.tag, tensor.note = "x", 5
    model = {"w": weight, "tied": weight, "row": weight[0], "p": parameter, "t": tensor,
             "f8": torch.zeros(2, dtype=torch.float8_e4m3fn), "wide": torch.empty(300, 300, 2, 2, 2, 2)}  # fmt: skip
    values = {"set": {1, "a"}, "bytes": b"\x00\xff", "bytearray": bytearray(b"xy"), "none": bytearray(), "complex": 1j,
              "counter": collections.Counter("aab"), "ordered": collections.OrderedDict(a=1),
              "device": torch.device("cpu"), "dtype": torch.float32, "size": torch.Size([2, 3]),
              "keys": {0: "a", 1 << 40: "b", 0.5: "c"}}  # fmt: skip
    torch.save({"model": model, "values": values}, tmp_path / "plain.pt")
    monkeypatch.setattr(torch_files, "MAX_VISITS", torch_files.VISITS_PER_TENSOR * (len(model) + len(values)))
    state = importers.read_source(tmp_path / "plain.pt").state
    assert state["values"] == values and torch.equal(state["model"]["row"], weight[0])


def test_a_file_saved_with_a_pickle_protocol_torch_load_cannot_read_says_so(tmp_path):
    """torch.save(pickle_protocol=4 or 5) writes opcodes torch.load(weights_only=True) does not
    read; the refusal showed only torch's preamble ('Weights only load failed. In PyTorch 2.6,
    we changed the default value of the weights_only argument'), not why nor what to do."""
    for protocol in (4, 5):
        torch.save({"w": torch.ones(2)}, tmp_path / f"p{protocol}.pt", pickle_protocol=protocol)
        with pytest.raises(
            CkptflowError, match=rf"p{protocol}.pt was pickled with protocol {protocol}.*pickle_protocol"
        ):
            importers.read_source(tmp_path / f"p{protocol}.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "p3.pt", pickle_protocol=3)
    assert importers.read_source(tmp_path / "p3.pt").state["model"]["w"].tolist() == [1, 1]


@pytest.mark.parametrize(
    ("value", "named"), [(os.getcwd, "posix.getcwd"), (torch.nn.Linear, "torch.nn.modules.linear.Linear")]
)
def test_what_torch_load_refuses_is_named(tmp_path, value, named):
    """A global torch.load does not allow, referred to but not called: the walk passes it, and
    torch.load's refusal is quoted past its preamble. A global outside a blocked module (a
    class) read as torch's preamble's "(1) In PyTorch 2.6, we changed the default value of
    the `weights_only` argument ... Re-running `torch.load` with `weights_only` set to `False`
    will likely succeed", naming nothing and advising what ckptflow never does."""
    torch.save({"w": torch.ones(2), "f": value}, tmp_path / "global.pt")
    with pytest.raises(CkptflowError) as err:
        importers.read_source(tmp_path / "global.pt")
    message = str(err.value)
    assert "global.pt holds pickled objects" in message and f"GLOBAL {named}" in message, message
    assert "weights_only` set to `False`" not in message and "add_safe_globals" not in message, message


def test_a_string_counts_by_its_length_each_time_it_is_referenced(tmp_path, monkeypatch):
    """Dicts keyed by two 64 KB strings, each holding the one below twice: the save writes
    every key of every path. A string weighed one object per 64 bytes, so the bound admitted
    6.4 GB of them (a 132 KB file nesting 10 deep wrote 255 MB and took 1.06 GB; 14 deep
    took read_source 16 s); per 16 bytes it admits what as many objects cost. Bound lowered:
    6 deep holds 256 keys, 16 MB, each weighing 4,097."""
    monkeypatch.setattr(torch_files, "MAX_VISITS", 1_000_000)
    keys = [b"X" + struct.pack("<I", 1 << 16) + letter * (1 << 16) + b"r" + struct.pack("<I", 7000 + i)
            for i, letter in enumerate((b"a", b"b"))]  # fmt: skip
    tree = b"}" + b"r" + struct.pack("<I", 8000)
    for level in range(1, 7):
        below = b"j" + struct.pack("<I", 8000 + level - 1)
        tree += b"}(" + b"j" + struct.pack("<I", 7000) + below + b"j" + struct.pack("<I", 7001) + below + b"u"
        tree += b"r" + struct.pack("<I", 8000 + level)
    torch_file_with(tmp_path / "keys.pt", b"](" + keys[0] + keys[1] + tree + b"e")  # the keys and every level listed
    assert tmp_path.joinpath("keys.pt").stat().st_size < 140_000
    _refused(tmp_path / "keys.pt", "keys.pt builds values holding more than 1000000 objects counted with all")


_IMPORT_IN_A_PROCESS = """
import sys
from ckptflow.errors import CkptflowError
from ckptflow.interop import dcp_metadata_file, importers
try:
    if sys.argv[1] == "metadata":
        dcp_metadata_file.read_metadata(sys.argv[2])
    else:
        importers.import_checkpoint(sys.argv[2] + "/store", "r", 1, sys.argv[2] + "/deep.pt")
except CkptflowError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("where", ["pt", "metadata"])
def test_a_value_nested_deeper_than_any_state_is_refused_before_hashing_it_crashes_the_process(tmp_path, where):
    """A dict keyed by a tuple nested 200,000 deep (200 KB: a TUPLE1 a level) passed every bound
    of the walk; hashing it recursed in C until the import process died of SIGSEGV."""
    deep = b"})" + b"\x85" * 200_000 + b"K\x01s"
    if where == "metadata":
        (tmp_path / ".metadata").write_bytes(b"\x80\x02" + deep + b".")
    else:
        torch_file_with(tmp_path / "deep.pt", deep)
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_IN_A_PROCESS, where, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"nests values deeper than {pickle_walk.MAX_DEPTH} levels" in done.stdout, done.stdout
    assert not (tmp_path / "store" / "runs").exists()
