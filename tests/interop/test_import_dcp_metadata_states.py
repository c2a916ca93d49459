"""A DCP ``.metadata`` may set the state (BUILD) only of the objects its unpickler constructs,
and may not key its storage entries by ``MetadataIndex`` that share a hash.

81 bytes of ``.metadata`` looked up DCP's enum member ``_MEM_FORMAT_ENCODING(0)`` (an allowed
global: TensorProperties' memory format) and set its ``_value_`` to 99 with a BUILD: the import
was refused ("it holds a _MEM_FORMAT_ENCODING"), but the member stayed changed for the whole
process. A ``MetadataIndex`` hashes as its name and offset, a size whose hash the file chooses:
5,000 keys of one name sharing a hash (310 KB) took the import 4.2 s (quadratic), and the walk counted
none of them, as it knows no hash of what a call returns.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptflow.errors import DcpFormatError
from ckptflow.interop import dcp_metadata_file, importers
from ckptflow.interop.pickle_keys import MAX_COLLIDABLE_KEYS

CONTIGUOUS = dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
# _MEM_FORMAT_ENCODING(0), then BUILD {"_value_": 99}: the enum member looked up, its value set
ENUM_VALUE_SET = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R}\x8c\x07_value_Kcsb."
)


def _restore_enum() -> None:
    """The member as it was, for the tests after this one, if a BUILD changed it."""
    if CONTIGUOUS.value != 0:
        CONTIGUOUS._value_ = 0


def test_a_build_on_an_enum_member_is_refused_before_the_member_changes(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(ENUM_VALUE_SET)
    try:
        with pytest.raises(DcpFormatError) as refused:
            importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "dcp")
        assert CONTIGUOUS.value == 0
    finally:
        _restore_enum()
    message = str(refused.value)
    assert "sets attributes of what torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING returns" in message
    assert "refused before it is unpickled" in message
    assert not (tmp_path / "store" / "runs").exists()


def test_the_metadata_unpickler_itself_sets_no_state_of_what_it_did_not_construct():
    """The walk refuses the file first; the unpickler holds if it did not."""
    try:
        with pytest.raises(DcpFormatError, match=r"sets attributes of .*TORCH_CONTIGUOUS_FORMAT.* \(a BUILD on a _MEM"):
            dcp_metadata_file._MetadataUnpickler(io.BytesIO(ENUM_VALUE_SET), "DCP metadata x").load()
        assert CONTIGUOUS.value == 0
    finally:
        _restore_enum()


# CPython's tuple hash (xxHash's rounds): each item's hash added times P2, rotated, times P1
_P1, _P2, _P5, _MASK = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1


def _offsets_hashing_alike(count: int) -> list[torch.Size]:
    """``count`` distinct 2-d offsets of one tuple hash: the last round inverted for each first item."""
    target = hash((0, 0)) & _MASK
    before_length = (target - (2 ^ _P5 ^ 3527539)) & _MASK
    rotated = before_length * pow(_P1, -1, 1 << 64) & _MASK
    wanted = ((rotated >> 31) | (rotated << 33)) & _MASK  # rotated right by 31
    offsets = []
    first = 1
    while len(offsets) < count:
        acc = (_P5 + first * _P2) & _MASK
        acc = ((acc << 31) | (acc >> 33)) & _MASK
        lane = (wanted - acc * _P1) * pow(_P2, -1, 1 << 64) & _MASK
        second = lane - (1 << 64) if lane >> 63 else lane  # the int whose hash is the lane, if one is
        if abs(second) < (1 << 61) - 1 and second != -1:
            offsets.append(torch.Size([first, second]))
        first += 1
    assert len({hash(o) for o in offsets}) == 1 and len(set(map(tuple, offsets))) == count
    return offsets


def _storage_metadata(directory, offsets: list[torch.Size]) -> None:
    tensor = dcp_metadata.TensorStorageMetadata(
        properties=dcp_metadata.TensorProperties(dtype=torch.float32), size=torch.Size([0, 0]), chunks=[]
    )
    storage = {dcp_metadata.MetadataIndex("w", offset): _StorageInfo("__0_0.distcp", 0, 0) for offset in offsets}
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(dcp_metadata.Metadata({"w": tensor}, storage_data=storage)))


def test_storage_keys_sharing_a_hash_are_refused_before_they_are_all_inserted(tmp_path):
    _storage_metadata(tmp_path / "crafted", _offsets_hashing_alike(MAX_COLLIDABLE_KEYS + 1))
    with pytest.raises(DcpFormatError) as refused:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "crafted")
    assert f"more than {MAX_COLLIDABLE_KEYS} MetadataIndex (a name and an offset) sharing a hash" in str(refused.value)
    assert not (tmp_path / "store" / "runs").exists()
    # as many keys of one name whose hashes differ, as a tensor saved in as many pieces has, are read
    _storage_metadata(tmp_path / "pieces", [torch.Size([i, 0]) for i in range(MAX_COLLIDABLE_KEYS + 1)])
    read = dcp_metadata_file.read_metadata(str(tmp_path / "pieces"))
    assert len(read.storage_data) == MAX_COLLIDABLE_KEYS + 1
