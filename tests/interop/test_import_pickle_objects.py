"""What a torch.save pickle builds without a call is bounded before ``torch.load`` runs.

The pickle's calls were counted (``MAX_CALLS``), but an empty dict is one byte of pickle
(EMPTY_DICT) and ~70 once built, with no call: a 40 MB .pt of 40 million of them passed the
count, took torch.load 20 s and 3.3 GB, and the whole import 165 s and 8.2 GB, and was
committed. Every object the pickle builds is now counted (``MAX_OBJECTS``), and a DCP
directory's items together share one file's bounds. The count ran before the entries were
proved stored: a 98 KB file whose data.pkl deflates to 100 MB of opcodes was walked for 54 s
before the compression was refused (40 MB would run for hours); the stored check comes first.
Bounds lowered: a file near the real ones takes minutes to write and read.
"""

from __future__ import annotations

import io
import re
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptflow.errors import CkptflowError, DcpFormatError
from ckptflow.interop import importers, pickle_walk, torch_files
from ckptflow.interop.dcp_dir import read_state

LIMIT = 1000


def _with_pickle(path, pickle: bytes, *, compress: int = zipfile.ZIP_STORED) -> None:
    """A torch.save zip of one tensor whose data.pkl is replaced by ``pickle``."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name in source.namelist():
            if name.endswith("/data.pkl"):
                out.writestr(name, pickle, compress_type=compress)
            else:
                out.writestr(name, source.read(name))


def _dicts_file(path, count: int) -> None:
    """{"model": {"w": tensor}, "junk": [count empty dicts]}: torch.save's pickle with the list
    written as an attacker would, one byte per dict (EMPTY_DICT) and no call."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    body = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))[2:-1]  # no PROTO, STOP
    junk = b"X\x04\x00\x00\x00junk](" + b"}" * count + b"e"  # EMPTY_LIST MARK {}... APPENDS
    _with_pickle(path, b"\x80\x02}(X\x05\x00\x00\x00model" + body + junk + b"u.")


def test_a_torch_file_of_objects_built_without_calls_is_refused_before_torch_load(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_files, "MAX_OBJECTS", LIMIT)
    _dicts_file(tmp_path / "dicts.pt", LIMIT)
    _dicts_file(tmp_path / "fits.pt", 10)
    assert len(torch.load(tmp_path / "dicts.pt", weights_only=True)["junk"]) == LIMIT  # what it would build
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    with pytest.raises(CkptflowError, match=f"dicts.pt builds more objects .* than the {LIMIT} a file of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dicts.pt")
    assert not (tmp_path / "store" / "runs").exists()
    monkeypatch.setattr(torch, "load", real_load)
    result = importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "fits.pt")
    assert result.tensors == 1


def test_marks_count_as_objects(tmp_path, monkeypatch):
    """A MARK builds nothing the walk counted, but torch.load's unpickler makes a list of each:
    10 MB of them before a one-tensor pickle took the import 18 s and 0.7 GB, and it was committed."""
    monkeypatch.setattr(torch_files, "MAX_OBJECTS", LIMIT)
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pickle = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    _with_pickle(tmp_path / "marks.pt", pickle[:2] + b"(" * LIMIT + pickle[2:])  # after PROTO; STOP ignores them
    assert torch.load(tmp_path / "marks.pt", weights_only=True)["w"].shape == (4,)
    with pytest.raises(CkptflowError, match=f"marks.pt builds more objects .* than the {LIMIT} a file of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "marks.pt")
    assert not (tmp_path / "store" / "runs").exists()


def test_memo_writes_by_memoize_count_as_objects(tmp_path, monkeypatch):
    """MEMOIZE (one byte) writes the memo at its length, as LONG_BINPUT writes it at the index it
    gives, but was not counted: 5 million of them on one None (5 MB) passed the walk in 8.4 s, its
    memo 320 MB (1 GB of them would be 64 GB), and CPython's unpickler's memo grows as long."""
    monkeypatch.setattr(torch_files, "MAX_OBJECTS", LIMIT)
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    body = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))[2:-1]  # no PROTO, STOP
    junk = b"X\x04\x00\x00\x00junkN" + b"\x94" * LIMIT  # None, MEMOIZE...
    _with_pickle(tmp_path / "memoize.pt", b"\x80\x02}(X\x05\x00\x00\x00model" + body + junk + b"u.")
    with pytest.raises(CkptflowError, match=f"memoize.pt builds more objects .* than the {LIMIT} a file of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "memoize.pt")
    assert not (tmp_path / "store" / "runs").exists()


def test_a_real_state_dict_stays_well_within_the_objects_per_tensor(tmp_path, monkeypatch):
    """torch.save builds fewer than ``OBJECTS_PER_TENSOR`` objects per tensor: a file of
    ``n`` tensors passes a bound of ``n`` tensors."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    state = BertModel(config).state_dict()
    state["wide"] = torch.empty(300, 300, 2, 2, 2, 2)  # sizes and strides above 255: more objects than most
    torch.save(state, tmp_path / "bert.pt")
    monkeypatch.setattr(torch_files, "MAX_OBJECTS", torch_files.OBJECTS_PER_TENSOR * len(state))
    assert importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "bert.pt").tensors == len(state)


def test_dcp_items_share_one_bound(tmp_path, monkeypatch):
    """Each item was bounded on its own, so a directory of many items built as many times more."""
    monkeypatch.setattr(torch_files, "MAX_OBJECTS", LIMIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        for name, items in (("one", 1), ("two", 2)):
            state = {"w": torch.zeros(2), **{f"v{i}": tuple({} for _ in range(600)) for i in range(items)}}
            dcp.save(state, checkpoint_id=str(tmp_path / name))
    assert len(read_state(str(tmp_path / "one"))["v0"]) == 600
    with pytest.raises(DcpFormatError, match=f"builds more objects .* than the {LIMIT} a file of"):
        read_state(str(tmp_path / "two"))


def test_a_compressed_pickle_is_refused_before_it_is_read(tmp_path, monkeypatch):
    _with_pickle(tmp_path / "bomb.pt", b"\x80\x02" + b"N0" * 100_000 + b"N.", compress=zipfile.ZIP_DEFLATED)
    monkeypatch.setattr(pickle_walk.pickletools, "genops", lambda *a: pytest.fail("the inflated pickle was read"))
    with pytest.raises(CkptflowError, match="holds 'archive/data.pkl' compressed"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "bomb.pt")
    assert not (tmp_path / "store" / "runs").exists()


@pytest.mark.parametrize("keep_vars", [False, True], ids=["tensors", "Parameters"])
def test_a_file_of_as_many_tensors_as_an_import_takes_is_within_the_calls_bound(tmp_path, keep_vars):
    """torch.save made two calls per tensor and two more per file, so ``MAX_CALLS = 2 x
    MAX_NAMES`` refused a file of exactly ``MAX_NAMES`` tensors, which the name bound admits;
    and four per Parameter (``state_dict(keep_vars=True)``), so 524,289 were refused. A
    tensor's hooks' empty ``OrderedDict()`` counts as an object: one call per tensor, two per
    Parameter. Counted on real files of 40 and 80: each adds the same calls, so the count at
    ``MAX_NAMES`` is exact."""
    from ckptflow.interop.source_files import MAX_NAMES

    def calls(n: int) -> int:  # a module's state_dict: an OrderedDict with its _metadata
        module = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(n // 2)))
        torch.save(module.state_dict(keep_vars=keep_vars), tmp_path / f"{n}.pt")
        budget = torch_files.PickleBudget()
        torch_files.check_plain_zip(tmp_path / f"{n}.pt", "test", budget=budget)
        return budget.calls

    per_tensor = (calls(80) - calls(40)) / 40
    assert per_tensor == (torch_files.CALLS_PER_TENSOR if keep_vars else 1)
    at_the_name_bound = calls(40) + per_tensor * (MAX_NAMES - 40)
    assert at_the_name_bound <= torch_files.MAX_CALLS


def test_a_file_of_as_many_parameters_as_the_calls_refusal_names_imports(tmp_path, monkeypatch):
    """A Parameter made four calls, so a ``state_dict(keep_vars=True)`` of 600,000 of them,
    within the 2^20 names an import takes, was refused as building 'more objects by calls (a
    tensor is one) than the 2097168 a file of 1048576 tensors makes'. Bound lowered to 100."""
    monkeypatch.setattr(torch_files, "MAX_CALLS", 2 * 100 + torch_files.CALLS_PER_FILE)

    def saved(n: int):
        module = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(1)) for _ in range(n))
        torch.save(module.state_dict(keep_vars=True), tmp_path / f"{n}.pt")
        return tmp_path / f"{n}.pt"

    with pytest.raises(CkptflowError, match=r"builds more objects by calls .* a file of \d+ \w+ makes") as refused:
        importers.read_source(saved(300))
    claimed = int(re.search(r"a file of (\d+) ", str(refused.value)).group(1))
    assert claimed == 100
    state = importers.read_source(saved(claimed)).state
    assert len(state["model"]) == claimed and all(t.tolist() == [1.0] for t in state["model"].values())


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_is_refused_by_name(tmp_path, layout):
    """torch.save writes ``_rebuild_nested_tensor`` for a nested tensor (``_rebuild_njt`` for a
    jagged one), which the walk refused as 'a call torch.save writes for no tensor or plain
    value', naming neither the nested tensor nor what to save instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested's prototype warning
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    torch.save({"w": torch.ones(2), "nested": nested}, tmp_path / "nested.pt")
    with pytest.raises(CkptflowError) as refused:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "nested.pt")
    message = str(refused.value)
    assert "nested.pt holds a nested tensor (torch.nested" in message, message
    assert "t.unbind()" in message and "to_padded_tensor" in message and "writes for no tensor" not in message
    assert not (tmp_path / "store" / "runs").exists()
