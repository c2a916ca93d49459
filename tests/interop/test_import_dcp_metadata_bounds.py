"""What a DCP ``.metadata`` makes ckptflow build is bounded by the metadata of as many tensors
as one import takes, before it is unpickled or walked.

``.metadata`` was capped at 1 GB of input only, and its restricted unpickler builds whatever
the opcodes say: an empty dict is 2 bytes of pickle and ~70 once built (20 MB of them took
the import 0.8 GB), and a memo written at index 2^28 (9 bytes) makes CPython's unpickler
grow its memo to 4 GB. Memo reads (2 bytes each) repeat one chunk in a chunk list, or one
tensor description under many names, and the checks then visited every piece of every name:
an 8 MB list of 4 million empty chunks took 0.7 GB; 10,000 names sharing one description of
10,000 chunks (126 KB) took 128 s; both were imported. The pickle is now walked first
(``pickle_walk.count_built``, the rule a ``.pt`` file's pickle is read by; memo reads and
writes counted), and the pieces of all names counted against ``MAX_NAMES`` before a piece is
visited. Bounds lowered where a file near the real ones takes minutes to write.
"""

from __future__ import annotations

import pathlib
import pickle
import struct
import tracemalloc
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptflow.errors import DcpFormatError
from ckptflow.interop import dcp_dir, dcp_metadata_file, importers
from ckptflow.interop.source_files import MAX_NAMES

LIMIT = 1000
EMPTY_CHUNK = dcp_metadata.ChunkStorageMetadata(torch.Size([0]), torch.Size([0]))


def _empty_tensor(chunks: list) -> dcp_metadata.TensorStorageMetadata:
    """A tensor of no elements: its pieces, empty, need no stored item and tile it whatever their number."""
    return dcp_metadata.TensorStorageMetadata(
        properties=dcp_metadata.TensorProperties(dtype=torch.float32), size=torch.Size([0]), chunks=chunks
    )


def _metadata_directory(directory, metadata: dcp_metadata.Metadata, *, protocol: int = pickle.HIGHEST_PROTOCOL):
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
    return directory


def _refused_unpickled(monkeypatch) -> None:
    def unpickled(self):
        raise AssertionError("the metadata was unpickled before what it builds was counted")

    monkeypatch.setattr(dcp_metadata_file._MetadataUnpickler, "load", unpickled)


def test_metadata_building_more_objects_than_its_bound_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_metadata_file, "MAX_METADATA_OBJECTS", LIMIT, raising=False)
    dicts = [{} for _ in range(LIMIT)]  # 2 bytes of pickle each (EMPTY_DICT, MEMOIZE), ~70 once built
    crafted = _metadata_directory(
        tmp_path / "dicts", dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}, version=dicts)
    )
    fits = _metadata_directory(
        tmp_path / "fits", dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}, version=dicts[:10])
    )
    assert importers.import_checkpoint(str(tmp_path / "fitting"), "r", 1, fits).tensors == 1
    _refused_unpickled(monkeypatch)
    with pytest.raises(DcpFormatError) as err:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, crafted)
    message = str(err.value)
    assert f"DCP metadata {crafted / '.metadata'} builds more objects" in message
    assert f"than the {LIMIT} the metadata of {LIMIT // dcp_metadata_file.METADATA_OBJECTS_PER_TENSOR}" in message
    assert "import the checkpoint in parts" in message
    assert not (tmp_path / "store" / "runs").exists()


def test_memo_reads_count_as_objects(tmp_path, monkeypatch):
    """A chunk list of 2-byte memo reads of one chunk built nothing the walk counted."""
    monkeypatch.setattr(dcp_metadata_file, "MAX_METADATA_OBJECTS", LIMIT, raising=False)
    crafted = _metadata_directory(
        tmp_path / "refs", dcp_metadata.Metadata({"w": _empty_tensor([EMPTY_CHUNK] * LIMIT)}, storage_data={})
    )
    assert (crafted / ".metadata").stat().st_size < 3 * LIMIT
    _refused_unpickled(monkeypatch)
    with pytest.raises(DcpFormatError, match=f"builds more objects .* than the {LIMIT} the metadata of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, crafted)


def test_a_memo_written_at_a_far_index_is_refused_before_the_unpickler_makes_its_memo_that_long(tmp_path):
    """Five bytes (LONG_BINPUT) made CPython's unpickler allocate twice the index in memo slots:
    at this index, 2 GB; the largest a 4-byte index says, 64 GB. At the real bound."""
    index = dcp_metadata_file.MAX_METADATA_OBJECTS + 1
    directory = _metadata_directory(
        tmp_path / "memo", dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}), protocol=2
    )
    data = (directory / ".metadata").read_bytes()
    assert data.endswith(b".")  # STOP: memoize the Metadata once more, far off, before it
    (directory / ".metadata").write_bytes(data[:-1] + b"r" + struct.pack("<I", index) + b".")
    with pytest.raises(DcpFormatError, match="builds more objects"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)


def test_memo_writes_by_memoize_count_as_the_memo_they_make(tmp_path, monkeypatch):
    """MEMOIZE writes the memo at its length, as LONG_BINPUT at the index it gives, but a byte
    each, uncounted, they made the walk's memo and CPython's unpickler's as long as the file."""
    monkeypatch.setattr(dcp_metadata_file, "MAX_METADATA_OBJECTS", LIMIT)
    directory = _metadata_directory(
        tmp_path / "memo", dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}), protocol=4
    )
    data = (directory / ".metadata").read_bytes()
    assert data.endswith(b".")  # STOP: memoize the Metadata again and again before it
    (directory / ".metadata").write_bytes(data[:-1] + b"\x94" * LIMIT + b".")
    _refused_unpickled(monkeypatch)
    with pytest.raises(DcpFormatError, match=f"builds more objects .* than the {LIMIT} the metadata of"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)


@pytest.mark.parametrize(
    ("names", "pieces_each"),
    [(1, MAX_NAMES + 1), (1025, 1024)],
    ids=["one-tensor-of-memo-read-pieces", "names-sharing-one-description"],
)
def test_more_pieces_than_an_import_takes_are_refused_before_one_is_checked(tmp_path, monkeypatch, names, pieces_each):
    """Every piece is a tensor read and placed; the items of a directory together were already
    bounded to ``MAX_NAMES`` tensors, but only once read. A name's pieces count for every name
    that shares its description: the checks visit them per name. At the real bound."""
    shared = _empty_tensor([EMPTY_CHUNK] * pieces_each)
    directory = _metadata_directory(
        tmp_path / "pieces",
        dcp_metadata.Metadata({hex(i): shared for i in range(names)}, storage_data={}),
    )
    assert (directory / ".metadata").stat().st_size < 4 << 20

    def per_piece(*args):
        raise AssertionError("the pieces were checked before they were counted")

    monkeypatch.setattr(dcp_dir, "_check_items", per_piece)
    with pytest.raises(DcpFormatError) as err:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    message = str(err.value)
    total = names * pieces_each
    assert f"DCP metadata {directory / '.metadata'} names {total} tensor pieces" in message
    assert f"more than the {MAX_NAMES} one import takes" in message and "Import it in parts" in message
    assert not (tmp_path / "store" / "runs").exists()


def test_a_saved_path_for_a_name_the_checkpoint_lacks_is_refused(tmp_path):
    """DCP writes a path for each name it stores and none other; paths of names that are not
    there were checked (each up to 128 keys) and then ignored, whatever their number."""
    directory = _metadata_directory(
        tmp_path / "paths",
        dcp_metadata.Metadata(
            {"w": _empty_tensor([])}, storage_data={}, planner_data={"w": ("w",), "ghost": ("model", "ghost")}
        ),
    )
    with pytest.raises(DcpFormatError, match="planner_data gives a path for 'ghost', which names nothing"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)


def test_a_saved_path_is_measured_before_its_keys_are_read(tmp_path):
    """Every key of every path was read before any path's depth was checked: one path of a
    million keys (memo reads, 2 bytes each) shared by a million names is 10^12 keys to read.
    A path deeper than a state nests is refused on its depth, its keys unread."""
    from ckptflow.format.sealed import MAX_DEPTH

    deep = ("model",) * MAX_DEPTH + (1.5,)  # its last key, not a string or an index, is never reached
    directory = _metadata_directory(
        tmp_path / "deep",
        dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}, planner_data={"w": deep}),
    )
    with pytest.raises(DcpFormatError, match=f"the saved path of 'w' is {MAX_DEPTH + 1} keys deep"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)


def test_deep_saved_paths_are_checked_in_memory_linear_in_their_keys(tmp_path):
    """Each list index in a saved path keyed its list by a copy of the path before it, so a
    path cost the square of its depth: 1,000 names with paths 128 keys deep (2 bytes a key,
    280 KB) took 77 MB to check, 10,000 (2.8 MB) 0.7 GB, a million would take 70 GB. A list
    is now known by the number of the prefix it extends: 23 MB."""
    from ckptflow.format.sealed import MAX_DEPTH

    names = [hex(i) for i in range(1000)]
    directory = _metadata_directory(
        tmp_path / "deep",
        dcp_metadata.Metadata(
            dict.fromkeys(names, _empty_tensor([])),
            storage_data={},
            planner_data={name: (name,) + (0,) * (MAX_DEPTH - 1) for name in names},  # each a list in a list...
        ),
    )
    tracemalloc.start()
    try:
        dcp_metadata_file.read_metadata(str(directory))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak


def test_real_dcp_metadata_stays_well_within_its_objects_per_tensor(tmp_path, monkeypatch):
    """DCP's metadata of a model and its optimizer builds fewer than ``METADATA_OBJECTS_PER_TENSOR``
    objects per name: a directory of ``n`` names passes a bound of ``n`` tensors."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2))
    model(torch.zeros(1, 4, dtype=torch.long)).last_hidden_state.sum().backward()
    optim = torch.optim.AdamW(model.parameters())
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    described = dcp_metadata_file.read_metadata(str(tmp_path / "dcp")).state_dict_metadata
    tensors = sum(isinstance(item, dcp_metadata.TensorStorageMetadata) for item in described.values())
    monkeypatch.setattr(
        dcp_metadata_file, "MAX_METADATA_OBJECTS", dcp_metadata_file.METADATA_OBJECTS_PER_TENSOR * len(described)
    )
    assert importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dcp").tensors == tensors


class _LongPath:
    """Pickles as DCP pickles the path it saved to, ``PosixPath(*parts)``: one part 64 times,
    each a memo read of the first (4,000 characters naming 2,000 directories)."""

    def __reduce__(self):
        return pathlib.PosixPath, ("a/" * 2000,) * 64


def test_a_saved_path_longer_than_any_path_is_refused_before_it_is_built(tmp_path):
    """``PosixPath(*parts)`` splits every part into a list of its directories: a 600 KB
    ``.metadata`` repeating a 100 KB part 100,000 times took 3.6 GB before MemoryError (40 GB
    without a limit), within every bound of the walk."""
    directory = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(directory), no_dist=True)
    metadata = dcp_metadata_file.read_metadata(str(directory))
    assert metadata.storage_meta.checkpoint_id == directory  # DCP saves the path it was given
    metadata.storage_meta.checkpoint_id = _LongPath()
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DcpFormatError, match=r"gives the path it was saved to as 64 parts of 256000 characters"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not (tmp_path / "store" / "runs").exists()


@pytest.mark.parametrize("field", ["index", "offset"])
def test_a_number_too_long_to_print_is_a_damaged_file_not_a_traceback(tmp_path, field):
    """An integer of more than 4,300 digits raises ValueError when printed: a storage entry's
    index in the message naming the entry, its byte offset in the message bounding its file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    metadata = dcp_metadata_file.read_metadata(str(tmp_path / "dcp"))
    ((index, info),) = metadata.storage_data.items()
    if field == "index":
        index = dcp_metadata.MetadataIndex(fqn="nothing", offset=index.offset, index=10**5000)
    else:
        info.offset = 10**5000
    metadata.storage_data = {index: info}
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    shown = "storage entry .* names nothing" if field == "index" else "'w' has an invalid offset or length"
    with pytest.raises(DcpFormatError, match=f"{shown}.*the metadata is damaged"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dcp")


@pytest.mark.parametrize("field", ["state_dict_metadata", "properties", "offsets", "relative_path", "length"])
def test_metadata_lacking_a_field_dcp_gives_is_a_damaged_file_not_a_traceback(tmp_path, field):
    """Unpickling sets the fields the file holds: one renamed (a flipped byte) left the object
    without it, and the check's read of it raised AttributeError out of the import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    path = tmp_path / "dcp" / ".metadata"
    renamed = field[:-1] + ("X" if field[-1] != "X" else "Y")  # as long, so the pickle stays readable
    assert path.read_bytes().count(field.encode()) == 1
    path.write_bytes(path.read_bytes().replace(field.encode(), renamed.encode()))
    with pytest.raises(DcpFormatError, match=f"has no attribute '{field}'; the metadata is damaged or was not"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dcp")
    assert not (tmp_path / "store" / "runs").exists()


def test_a_frame_longer_than_any_file_is_a_damaged_file_not_a_traceback(tmp_path):
    """The unpickler raised OverflowError out of the import for a FRAME of 2^63 bytes (C's; Python's,
    which reads DCP metadata since a BUILD is checked as it runs, raises ValueError)."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + b"N.")
    with pytest.raises(DcpFormatError, match=r"is not readable DCP metadata \(ValueError: frame size > sys.maxsize"):
        dcp_metadata_file.read_metadata(str(tmp_path))


def test_tensor_properties_of_an_unknown_memory_format_are_a_damaged_file_not_a_traceback(tmp_path, monkeypatch):
    """TensorProperties' __setstate__ raised RuntimeError out of the import for a memory format
    encoding it does not know (a mutated byte made it a size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    metadata = dcp_metadata_file.read_metadata(str(tmp_path / "dcp"))
    with monkeypatch.context() as patched:
        patched.setattr(dcp_metadata.TensorProperties, "__getstate__", lambda p: (p.dtype, p.layout, False, 7, False))
        (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DcpFormatError, match=r"not readable DCP metadata \(RuntimeError: Invalid torch.memory_format"):
        dcp_metadata_file.read_metadata(str(tmp_path / "dcp"))


def test_metadata_setting_attributes_of_a_dcp_class_is_refused_before_the_class_changes(tmp_path):
    """A BUILD on a global sets the class's attributes (the unpickler's setattr): 90 bytes of
    ``.metadata``, refused themselves, set ``Metadata.__setstate__ = None``, and every DCP import
    after it in that process failed ('NoneType' object is not callable). No pickler writes it."""
    good = _metadata_directory(tmp_path / "good", dcp_metadata.Metadata({"w": _empty_tensor([])}, storage_data={}))
    (tmp_path / "crafted").mkdir()
    state = b"N}X\x0c\x00\x00\x00__setstate__Ns\x86"  # (None, {"__setstate__": None}): attributes to set
    (tmp_path / "crafted" / ".metadata").write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n" + state + b"b."
    )
    try:
        with pytest.raises(DcpFormatError, match=r"sets attributes of torch\.distributed\.checkpoint\.metadata\.Meta"):
            dcp_metadata_file.read_metadata(str(tmp_path / "crafted"))
        assert "__setstate__" not in vars(dcp_metadata.Metadata)
    finally:
        if "__setstate__" in vars(dcp_metadata.Metadata):  # the class as it was, for the tests after this one
            delattr(dcp_metadata.Metadata, "__setstate__")
    assert isinstance(dcp_metadata_file.read_metadata(str(good)), dcp_metadata.Metadata)
