"""torch.save files whose pickle is partly written by hand, for the import's bounds tests."""

from __future__ import annotations

import io
import zipfile

import torch


def torch_file_with(path, junk: bytes) -> None:
    """torch.save's zip of {"model": {"w": zeros(4)}, "junk": <junk>}, the pickle written by hand."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    name = next(n for n in source.namelist() if n.endswith("/data.pkl"))
    body = source.read(name)[2:-1]  # no PROTO, STOP
    pickle_bytes = b"\x80\x02}(X\x05\x00\x00\x00model" + body + b"X\x04\x00\x00\x00junk" + junk + b"u."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for entry in source.namelist():
            out.writestr(entry, pickle_bytes if entry == name else source.read(entry))
