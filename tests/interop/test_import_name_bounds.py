"""A source naming more tensors than one import takes is refused before anything is made per name.

Nothing on disk bounds how many tensors a source names: an empty tensor holds no data, so
each costs ~50 bytes of a safetensors header, or ~10 of DCP metadata pointing every name
at one pickled description, and kilobytes once imported (a 12 MB header of 200,000 empty
tensors took 1.6 GB and 17 s; safetensors allows a 100 MB header, DCP metadata 1 GB here).
The count is now checked first (``source_files.MAX_NAMES``), at its real size."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from ckptflow.errors import CkptflowError, DcpFormatError
from ckptflow.interop import dcp_dir, importers, source_files
from ckptflow.interop.source_files import MAX_NAMES

TOO_MANY = MAX_NAMES + 1


def empty_tensors_file(path, count: int) -> None:
    """A valid safetensors file of ``count`` empty float tensors: a header and no data."""
    entry = '"t%x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    header = ("{" + ",".join(entry % i for i in range(count)) + "}").encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)


class NoTensorRead:
    """``safe_open`` whose ``get_tensor`` fails the test: a tensor read before the count was refused."""

    real = staticmethod(importers.safe_open)

    def __init__(self, path, framework):
        self.opened = self.real(path, framework)

    def __enter__(self):
        self.inner = self.opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def metadata(self):
        return self.inner.metadata()

    def get_tensor(self, name):
        raise AssertionError(f"tensor {name!r} was read before the names were counted")


def test_a_safetensors_header_of_too_many_empty_tensors_is_refused_before_a_tensor_is_read(tmp_path, monkeypatch):
    path = tmp_path / "many.safetensors"
    empty_tensors_file(path, TOO_MANY)
    assert os.path.getsize(path) < 64 << 20  # within what safetensors itself reads (a 100 MB header)
    monkeypatch.setattr(importers, "safe_open", NoTensorRead)
    with pytest.raises(CkptflowError) as err:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, path)
    assert f"{path} names {TOO_MANY} tensors, more than the {MAX_NAMES} one import takes" in str(err.value)
    assert "refused before reading them" in str(err.value) and "Import it in parts" in str(err.value)
    assert not (tmp_path / "store" / "runs").exists()


def test_dcp_metadata_naming_too_many_empty_tensors_is_refused_before_anything_per_name(tmp_path, monkeypatch):
    """Every name points at one pickled description (about 10 bytes a name) and no item."""
    directory = tmp_path / "dcp"
    directory.mkdir()
    empty = dcp_metadata.TensorStorageMetadata(
        properties=dcp_metadata.TensorProperties(dtype=torch.float32), size=torch.Size([0]), chunks=[]
    )
    metadata = dcp_metadata.Metadata(
        state_dict_metadata=dict.fromkeys(map(hex, range(TOO_MANY)), empty), storage_data={}
    )
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f, protocol=pickle.HIGHEST_PROTOCOL)
    assert os.path.getsize(directory / ".metadata") < 16 * TOO_MANY

    def per_name(*args):
        raise AssertionError("the pieces of every name were checked before the names were counted")

    monkeypatch.setattr(dcp_dir, "_check_items", per_name)
    with pytest.raises(DcpFormatError, match=f"names {TOO_MANY} tensors, more than the {MAX_NAMES} one import"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, directory)
    assert not (tmp_path / "store" / "runs").exists()


def test_a_torch_file_of_too_many_tensors_is_refused_before_it_is_saved(tmp_path, monkeypatch):
    """``torch.load`` makes every tensor before they can be counted; the save is not reached.
    The bound lowered: writing a million tensors with torch.save takes minutes."""
    monkeypatch.setattr(source_files, "MAX_NAMES", 100)
    torch.save({hex(i): torch.empty(0) for i in range(101)}, tmp_path / "many.pt")
    monkeypatch.setattr(importers.Checkpointer, "save", lambda *a, **k: pytest.fail("saved"))
    with pytest.raises(CkptflowError, match="many.pt names 101 tensors, more than the 100 one import takes"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "many.pt")


def test_a_torch_file_is_counted_from_its_pickle_before_torch_load_builds_anything(tmp_path, monkeypatch):
    """The count after ``torch.load`` came too late: 300,000 empty views of one storage (23 MB
    of .pt) took torch.load 10 s and 470 MB (mmap=True the same: the cost is the tensor
    objects, not their bytes), and 2^20 of them 80 MB of file, 1.6 GB and 35 s, before the
    import refused them. The pickle's calls are counted opcode by opcode first (torch.save
    makes one per tensor, two per Parameter). The bound lowered to 100 Parameters: writing a
    million takes minutes."""
    from ckptflow.interop import torch_files

    limit = 2 * 100 + torch_files.CALLS_PER_FILE
    monkeypatch.setattr(torch_files, "MAX_CALLS", limit, raising=False)
    base = torch.zeros(1)
    torch.save({hex(i): base[0:0] for i in range(220)}, tmp_path / "views.pt")
    torch.save({hex(i): base[0:0] for i in range(100)}, tmp_path / "fits.pt")
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    with pytest.raises(
        CkptflowError, match=f"views.pt builds more objects by calls .* than the {limit} a file of 100 Parameters makes"
    ):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "views.pt")
    assert not (tmp_path / "store" / "runs").exists()
    monkeypatch.setattr(torch, "load", real_load)
    assert importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "fits.pt").tensors == 100
