"""A torch.save zip is checked in the directory ``torch.load`` reads, not another one.

``zipfile`` reads the central directory right before the end records (and zip64's end
record right before its locator), whatever offsets they hold; torch.load's reader (miniz)
reads it where the end record's offset, or the zip64 locator's, points. A file holding two
directories passed every check in the one ``zipfile`` read (every entry stored, the pickle
walked) while ``torch.load`` read the other: a 1 MB file, whose directory there lists the
tensor's bytes deflated, imported a 1 GB tensor (1.33 GB peak RSS). Both offsets must point
where ``zipfile`` reads.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest
import torch

from ckptflow.errors import CkptflowError
from ckptflow.interop import importers

ZEROS = 4096
_LOCAL = struct.Struct("<4s5H3L2H")  # a local entry header, before its name
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # a central directory record, before its name


def _two_directories(path, *, by_locator: bool) -> None:
    """torch.save's zip of ``ZEROS`` float zeros with a second directory: the one ``zipfile``
    reads lists every entry stored, as torch.save writes it; the one the end record's offset
    (``by_locator``: zip64's locator) points at lists the tensor's bytes deflated to a few."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(ZEROS)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pad = b"\0" * 4096  # an entry no directory lists, so offsets shifted by zipfile stay in the file
    out = io.BytesIO()
    out.write(_LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(pad), len(pad), len(pad), 3, 0) + b"pad" + pad)
    entries = []
    for info in source.infolist():
        data, name = source.read(info), info.filename.encode()
        deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
        stored = deflate.compress(data) + deflate.flush() if name.endswith(b"data/0") else data
        method = 8 if stored is not data else 0
        entries.append((name, out.tell(), method, zlib.crc32(data), len(stored), len(data)))
        out.write(_LOCAL.pack(b"PK\x03\x04", 20, 0, method, 0, 0, entries[-1][3], len(stored), len(data), len(name), 0))
        out.write(name + stored)

    def directory(*, as_stored: bool, shift: int = 0) -> bytes:
        return b"".join(
            _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, 0 if as_stored else method, 0, 0, crc, size,
                          size if as_stored else length, len(name), 0, 0, 0, 0, 0, offset - shift) + name
            for name, offset, method, crc, size, length in entries
        )  # fmt: skip

    read_by_torch = out.tell()
    out.write(directory(as_stored=False))
    count = len(entries)
    if by_locator:
        other_end64 = out.tell()
        out.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, out.tell() - read_by_torch,
                              read_by_torch))  # fmt: skip
        listed = directory(as_stored=True)
        start = out.tell()
        out.write(listed)
        out.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(listed), start))
        out.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, other_end64, 1))
        out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    else:
        listed = directory(as_stored=True, shift=out.tell() - read_by_torch)  # zipfile shifts offsets by the gap
        out.write(listed)
        out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(listed), read_by_torch, 0))
    path.write_bytes(out.getvalue())


@pytest.mark.parametrize("by_locator", [False, True], ids=["end record's offset", "zip64 locator"])
def test_a_zip_whose_end_records_point_at_another_directory_is_refused(tmp_path, by_locator):
    path = tmp_path / "two.pt"
    _two_directories(path, by_locator=by_locator)
    with zipfile.ZipFile(path) as archive:  # what the checks read: every entry stored, as torch.save writes it
        assert all(info.compress_type == zipfile.ZIP_STORED for info in archive.infolist())
    assert torch.load(path, weights_only=True)["w"].shape == (ZEROS,)  # torch.load reads the deflated one
    assert path.stat().st_size < 4096 + 4 * ZEROS  # the tensor's bytes are not in the file
    points = "zip64 locator points at byte" if by_locator else "end record places the zip directory at byte"
    with pytest.raises(CkptflowError, match=f"two.pt is not a readable torch.save file.*{points}"):
        importers.import_checkpoint(str(tmp_path / "store"), "r", 1, path)
    assert not (tmp_path / "store" / "runs").exists()


def test_torch_save_files_point_where_zipfile_reads(tmp_path):
    """torch.save always writes zip64's end records; both point at the one directory."""
    torch.save({"w": torch.arange(3.0), "n": 2}, tmp_path / "real.pt")
    assert importers.read_source(tmp_path / "real.pt").state["w"].tolist() == [0, 1, 2]
