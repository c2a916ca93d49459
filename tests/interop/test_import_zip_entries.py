"""A torch.save zip listing more entries than a file of as many tensors as one import takes
is refused before ``zipfile`` reads its directory.

``zipfile.ZipFile`` makes a ZipInfo of every record in the central directory (~500 bytes
for 46 on disk, whatever the count the end record claims) before any bound was checked:
a 95 MB file of 2 million empty records took the import 1.2 GB before the entries were
looked at. torch.save writes one entry per storage and six of its own, so the end record's
count (zip64's too) and then the records the directory holds are checked against
``MAX_ENTRIES`` first. And a record of a zip version ``zipfile`` does not read raised
``NotImplementedError`` out of the import, a traceback for a damaged file.
"""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from ckptflow.errors import CkptflowError
from ckptflow.interop import importers, torch_files
from ckptflow.interop.source_files import MAX_NAMES

_RECORD = struct.Struct("<4s4B4HL2L5H2L")  # a central directory record, before its name


def listing(path, extra: int, *, claim: int | None = None) -> None:
    """A torch.save file of one tensor whose central directory lists ``extra`` more records
    (empty stored entries), ended by a zip64 end record claiming ``claim`` entries (default:
    those it holds)."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        start, held = archive.start_dir, len(archive.infolist())
    records = data[start : data.rfind(b"PK\x06\x06")]  # torch.save ends every file with zip64's end records
    assert len(records) > 0 and b"PK\x05\x06" not in records
    names = (b"archive/extra/%d" % i for i in range(extra))
    records += b"".join(_RECORD.pack(b"PK\x01\x02", 20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, len(n), 0, 0, 0, 0, 0, 0) + n
                        for n in names)  # fmt: skip
    count = held + extra if claim is None else claim
    end64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(records), start)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, start + len(records), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(data[:start] + records + end64 + locator + end)


def _directory_unread(monkeypatch) -> None:
    monkeypatch.setattr(torch_files.zipfile, "ZipFile", lambda *a, **k: pytest.fail("ZipFile read the directory"))


def test_a_zip_whose_end_record_claims_more_entries_than_an_import_takes_is_refused_unread(tmp_path, monkeypatch):
    """The zip64 end record's count, at the real bound: 8 bytes can claim 2^64 entries."""
    listing(tmp_path / "claims.pt", 0, claim=torch_files.MAX_ENTRIES + 1)
    _directory_unread(monkeypatch)
    with pytest.raises(CkptflowError) as err:
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, tmp_path / "claims.pt")
    message = str(err.value)
    assert f"claims.pt lists {torch_files.MAX_ENTRIES + 1} entries in its zip directory" in message
    assert f"more than the {torch_files.MAX_ENTRIES} a torch.save file of {MAX_NAMES} tensors holds" in message
    assert "Import it in parts" in message
    assert not (tmp_path / "store" / "runs").exists()


def test_a_zip_directory_holding_more_records_than_its_end_record_claims_is_refused_unread(tmp_path, monkeypatch):
    """``zipfile`` reads every record in the directory's bytes, whatever the count claims.
    The bound lowered: a directory of a million records is 60 MB."""
    monkeypatch.setattr(torch_files, "MAX_ENTRIES", 100, raising=False)
    listing(tmp_path / "fits.pt", 100 - 7)  # torch.save's 7 entries and 93 more
    listing(tmp_path / "holds.pt", 100 - 7 + 1, claim=1)
    assert importers.read_source(tmp_path / "fits.pt").state["model"]["w"].tolist() == [0, 1, 2, 3]
    _directory_unread(monkeypatch)
    with pytest.raises(CkptflowError, match="holds.pt lists more than 100 entries in its zip directory"):
        importers.read_source(tmp_path / "holds.pt")


def test_a_file_of_as_many_tensors_as_an_import_takes_is_within_the_entry_bound(tmp_path):
    """torch.save writes one entry per storage and a few of its own: counted on real files
    of 40 and 80 tensors, a file of ``MAX_NAMES`` tensors lists at most ``MAX_ENTRIES``."""

    def entries(n: int) -> int:
        torch.save({str(i): torch.zeros(2) for i in range(n)}, tmp_path / f"{n}.pt")
        with zipfile.ZipFile(tmp_path / f"{n}.pt") as archive:
            return len(archive.infolist())

    per_tensor = (entries(80) - entries(40)) / 40
    assert per_tensor == 1
    assert entries(40) + per_tensor * (MAX_NAMES - 40) <= torch_files.MAX_ENTRIES


def test_a_record_of_a_zip_version_zipfile_cannot_read_is_a_damaged_file(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "version.pt")
    data = bytearray((tmp_path / "version.pt").read_bytes())
    record = data.rfind(b"PK\x01\x02")
    data[record + 6 : record + 8] = struct.pack("<H", 99)  # needs zip 9.9 to extract
    (tmp_path / "version.pt").write_bytes(bytes(data))
    with pytest.raises(CkptflowError, match=r"version.pt is not a readable torch.save file.*zip file version 9.9"):
        importers.read_source(tmp_path / "version.pt")
