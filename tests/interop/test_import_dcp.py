"""Item 7 of issue 9: plain DCP directories in and out, never unpickling what a
directory could plant.

In: a directory written by ``dcp.save(..., storage_writer=FileSystemWriter(dir))``
becomes a checkpoint that restores exactly; hostile ``.metadata`` and BYTE_IO items are
refused without running (and the tests show DCP's own reader would have run them).
Out: ``export_dcp`` writes a directory ``dcp.load`` with ``FileSystemReader`` reads.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptflow import Checkpointer, CkptflowError
from ckptflow.errors import DcpFormatError
from ckptflow.interop.dcp_dir import read_state
from ckptflow.interop.export import export_dcp
from ckptflow.interop.importers import import_checkpoint
from support.states import tiny_state, tiny_train


class PlantsMarker:
    """Unpickling this creates ``path``: what a crafted checkpoint would do to its reader."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _assert_equal(a, b, where="state", *, mapping_types=True):
    """Equal values, types and key order (``mapping_types=False``: any dict type, as DCP
    rebuilds every mapping it flattened as a plain dict)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert (type(a) is type(b) or not mapping_types and isinstance(b, dict)) and list(a) == list(b), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}", mapping_types=mapping_types)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}.{i}", mapping_types=mapping_types)
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _trained(seed: int = 0) -> dict:
    state = tiny_state(seed)
    tiny_train(state, 3)
    return state


# ---- in: dcp.save -> import -> restore ------------------------------------------------
def test_dcp_directory_with_optimizer_restores_into_live_objects(tmp_path, make_ck):
    src = _trained(0)
    model_sd, optim_sd = get_state_dict(src["model"], src["optim"])
    saved = {"model": model_sd, "optim": optim_sd, "sched": src["sched"].state_dict(), "epoch": 3,
             "data": {"seen": [1, 2, 3], "name": "shard-7"}}  # fmt: skip
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)

    result = import_checkpoint(str(tmp_path / "store"), "imported", 30, tmp_path / "dcp")
    assert (result.format, result.entries) == ("dcp", ["model", "optim", "sched", "epoch", "data"])

    live = tiny_state(1)  # other weights, a fresh optimizer
    live.pop("extra")
    live.update(epoch=0, data={})
    restored = make_ck("imported", root=str(tmp_path / "store")).restore(live)
    assert restored.step == 30 and not restored.rng_restored  # an import stores no RNG
    _assert_equal(live["model"].state_dict(), src["model"].state_dict())
    _assert_equal(live["optim"].state_dict(), src["optim"].state_dict())
    _assert_equal(live["sched"].state_dict(), src["sched"].state_dict())
    assert live["epoch"] == 3 and live["data"] == {"seen": [1, 2, 3], "name": "shard-7"}
    for state in (live, src):  # training goes on exactly as from the source
        torch.manual_seed(5)
        tiny_train(state, 2)
    _assert_equal(live["model"].state_dict(), src["model"].state_dict())


def test_raw_optimizer_state_dict_comes_back_as_dcp_keeps_it(tmp_path, make_ck):
    """``optim.state_dict()`` (integer parameter ids) through DCP: DCP stringifies dict
    keys, so the imported state holds "0", "1", ...; lists and tuples keep their shape."""
    src = _trained(0)
    saved = {"optim": src["optim"].state_dict(), "pairs": [torch.ones(2), 3], "betas": (0.9, 0.99)}
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    import_checkpoint(str(tmp_path / "store"), "raw", 1, tmp_path / "dcp")
    _, loaded = make_ck("raw", root=str(tmp_path / "store")).load()
    expected = {str(k): v for k, v in src["optim"].state_dict()["state"].items()}
    _assert_equal(loaded["optim"]["state"], expected)
    assert loaded["optim"]["param_groups"] == src["optim"].state_dict()["param_groups"]
    _assert_equal(loaded["pairs"], [torch.ones(2), 3])
    assert loaded["betas"] == (0.9, 0.99)


def test_sharded_dcp_tensor_is_assembled(tmp_path):
    """A tensor stored as several chunks (as DCP writes the shards of a DTensor saved by
    two ranks) comes back whole; DCP's own reader agrees about the layout."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    directory = tmp_path / "d"
    dcp.save({"w": full}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    ((_, info),) = md.storage_data.items()
    pieces = []
    for start in (0, 3):
        buf = io.BytesIO()
        torch.save(full[start : start + 3].clone(), buf)
        pieces.append((start, buf.getvalue()))
    (directory / info.relative_path).write_bytes(b"".join(p for _, p in pieces))
    md.state_dict_metadata["w"].chunks = [
        ChunkStorageMetadata(torch.Size([s, 0]), torch.Size([3, 4])) for s, _ in pieces
    ]
    md.storage_data, offset = {}, 0
    for start, piece in pieces:
        md.storage_data[MetadataIndex("w", torch.Size([start, 0]))] = type(info)(info.relative_path, offset, len(piece))
        offset += len(piece)
    (directory / ".metadata").write_bytes(pickle.dumps(md))

    assert torch.equal(read_state(str(directory))["w"], full)
    out = {"w": torch.zeros(6, 4)}
    dcp.load(out, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    assert torch.equal(out["w"], full)


# ---- never unpickle -------------------------------------------------------------------
def test_hostile_metadata_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran-metadata"
    payload = pickle.dumps(PlantsMarker(str(marker)))
    pickle.loads(payload)  # the payload works: it plants the marker when unpickled
    assert marker.exists()
    marker.unlink()
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    (directory / ".metadata").write_bytes(payload)

    with pytest.raises(DcpFormatError, match=r"builtins\.exec.*not part of DCP's checkpoint metadata"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "store" / "runs")  # nothing committed


def test_hostile_byte_io_item_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran-byteio"
    directory = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3), "obj": PlantsMarker(str(marker))}, storage_writer=FileSystemWriter(directory),
             no_dist=True)  # fmt: skip
    assert not marker.exists()
    with pytest.raises(DcpFormatError, match=r"'obj' in .* calls builtins.exec in its pickle.*never unpickles"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not marker.exists()
    # DCP's own reader would have run it: the item really is hostile
    dcp.load({"w": torch.zeros(3), "obj": None}, storage_reader=FileSystemReader(directory), no_dist=True)
    assert marker.exists()


def test_a_byte_io_item_the_walk_refuses_says_to_load_it_with_dcp_if_trusted(tmp_path):
    """A non-tensor value torch.load(weights_only=True) refuses was told to dcp.load the
    checkpoint itself if trusted; refused by the pickle walk first, the advice was lost."""
    directory = str(tmp_path / "dcp")
    config = types.SimpleNamespace(lr=0.1)
    dcp.save({"w": torch.ones(3), "config": config}, storage_writer=FileSystemWriter(directory), no_dist=True)
    with pytest.raises(DcpFormatError) as refused:
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    message = str(refused.value)
    assert "'config' in" in message and "calls types.SimpleNamespace in its pickle" in message, message
    assert "if you trust the checkpoint, dcp.load it yourself and save the state through a Checkpointer" in message
    assert not os.path.exists(tmp_path / "store" / "runs")


def test_item_outside_the_directory_is_refused(tmp_path):
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(DcpFormatError, match="not a file name inside the directory"):
        read_state(str(directory))


@pytest.mark.parametrize("index", [-5, 10**9])
def test_list_index_out_of_range_is_refused_before_anything_is_built(tmp_path, index):
    directory = tmp_path / "dcp"
    dcp.save({"a": {"b": torch.ones(3)}}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    md.planner_data = {"a.b": ("a", index)}  # a list of a billion slots, or one before the first
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(DcpFormatError, match=r"'a\.b'.*list index outside 0\.\.0.*not written by DCP"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not (tmp_path / "store" / "runs").exists()


def _edit_chunk(md, **fields):
    (item,) = md.state_dict_metadata.values()
    item.chunks = [ChunkStorageMetadata(**{"offsets": item.chunks[0].offsets, "sizes": item.chunks[0].sizes, **fields})]


def _edit_storage(md, field, value):
    for index, info in md.storage_data.items():
        object.__setattr__(index if field == "offset" else info, field, value)  # MetadataIndex is frozen


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda md: _edit_chunk(md, offsets=5), "tensor 'w' has a malformed chunk"),
        (lambda md: _edit_chunk(md, sizes=("3",)), "tensor 'w' has a malformed chunk"),
        (lambda md: _edit_storage(md, "offset", 7), "'w' is stored at 7, not a position in the tensor"),
        (lambda md: _edit_storage(md, "transform_descriptors", 5), "'w' has transform descriptors 5, not a list"),
    ],
)
def test_a_field_of_another_type_is_refused_by_name(tmp_path, damage, said):
    """A chunk's offsets or sizes, an item's offset or its transforms of another type than
    DCP writes (an int, a string) crashed the import with a bare TypeError (no file named)."""
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    damage(md)
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(DcpFormatError) as err:
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert f"DCP metadata {directory / '.metadata'}: {said}" in str(err.value)
    assert "the metadata is damaged or was not written by DCP" in str(err.value)
    assert not (tmp_path / "store" / "runs").exists()


def test_truncated_item_is_refused(tmp_path):
    directory = tmp_path / "dcp"
    dcp.save({"w": torch.ones(1000)}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    (distcp,) = [p for p in directory.iterdir() if p.suffix == ".distcp"]
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(DcpFormatError, match="truncated"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)


# ---- out: ckptflow -> DCP directory -> dcp.load ------------------------------------
def test_export_dcp_reads_with_plain_dcp_load(tmp_path, make_ck):
    src = _trained(0)
    state = {**src, "epoch": 7, "meta": OrderedDict(b=1, a=[1.5, "x"]), "scale": np.float32(0.25)}
    ck = make_ck("r")
    ck.save(5, state, metadata={"loss": 0.5})
    out = tmp_path / "out"
    result = export_dcp(ck.store, "r", out)
    assert result.step == 5 and "ckptflow.json" in result.files and ".metadata" in result.files

    # a user of plain DCP, no ckptflow: the recommended get_state_dict / set_state_dict flow
    fresh = tiny_state(1)
    model_sd, optim_sd = get_state_dict(fresh["model"], fresh["optim"])
    target = {"model": model_sd, "optim": optim_sd, "sched": fresh["sched"].state_dict(), "extra": 0,
              "epoch": 0, "meta": OrderedDict(b=None, a=None), "scale": None}  # fmt: skip
    dcp.load(target, storage_reader=FileSystemReader(str(out)), no_dist=True)
    set_state_dict(fresh["model"], fresh["optim"], model_state_dict=target["model"], optim_state_dict=target["optim"])
    fresh["sched"].load_state_dict(target["sched"])
    _assert_equal(fresh["model"].state_dict(), src["model"].state_dict())
    _assert_equal(fresh["optim"].state_dict(), src["optim"].state_dict())
    _assert_equal(fresh["sched"].state_dict(), src["sched"].state_dict())
    assert (target["epoch"], target["extra"]) == (7, 3)
    assert target["meta"] == OrderedDict(b=1, a=[1.5, "x"]) and type(target["meta"]) is OrderedDict
    assert target["scale"] == np.float32(0.25) and type(target["scale"]) is np.float32


def test_export_then_import_is_the_same_checkpoint(tmp_path, make_ck):
    src = _trained(0)
    ck = make_ck("r")
    ck.save(5, {**src, "epoch": 7}, metadata={"loss": 0.5, "config": {"layers": 2}})
    export_dcp(ck.store, "r", tmp_path / "out", step=5)
    import_checkpoint(ck.store, "again", 5, tmp_path / "out")
    again = make_ck("again")
    _, before = ck.load(step=5)
    result, after = again.load(step=5)
    _assert_equal(after, before, mapping_types=False)
    assert result.metadata["config"] == {"layers": 2} and result.metadata["loss"] == 0.5  # via ckptflow.json
    assert result.metadata["import"]["format"] == "dcp"


def test_export_dcp_refuses_a_used_directory_and_leaves_it(tmp_path, make_ck):
    ck = make_ck("r")
    ck.save(1, {"w": torch.ones(2)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CkptflowError, match="not an empty directory"):
        export_dcp(ck.store, "r", out)
    assert os.listdir(out) == ["keep.txt"]


def test_import_refuses_a_committed_step_and_changes_nothing(tmp_path):
    directory = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(directory), no_dist=True)
    store = str(tmp_path / "store")
    first = import_checkpoint(store, "r", 1, directory)
    shutil.rmtree(directory)
    dcp.save({"w": torch.zeros(3)}, storage_writer=FileSystemWriter(directory), no_dist=True)
    with pytest.raises(CkptflowError, match="already committed"):
        import_checkpoint(store, "r", 1, directory)
    with Checkpointer(store, run="r") as ck:
        result, state = ck.load()
    assert torch.equal(state["w"], torch.ones(3)) and ck.list()[0].digest == first.digest


def test_a_saved_path_deeper_than_any_state_is_refused_before_anything_is_built(tmp_path):
    """Each list index was bounded by the number of items, but not how many lists a path
    makes: 1,000 names with one path 100,000 indexes deep (index 999 each) would rebuild
    10^8 list slots (800 MB) from 300 KB of metadata."""
    directory = tmp_path / "dcp"
    dcp.save({"a": [torch.ones(1) for _ in range(1000)]}, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    md = pickle.loads((directory / ".metadata").read_bytes())
    md.planner_data["a.0"] = ("a", *([999] * 100_000))
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(DcpFormatError, match=r"'a\.0' is 100001 keys deep, more than the 128"):
        import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not (tmp_path / "store" / "runs").exists()
