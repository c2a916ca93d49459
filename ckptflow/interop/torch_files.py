"""The one check made on torch.save bytes before ``torch.load`` reads them: a ``.pt`` file
imported (``importers``) and every item of a DCP directory (``dcp_dir``).

``torch.load(weights_only=True)`` refuses pickled objects, but it trusts the sizes in the
file. Two formats reach it:

- torch.save's zip (what it has written since PyTorch 1.6) stores every entry
  uncompressed, so what ``torch.load`` allocates for an entry fits in the file. A
  compressed entry is inflated to whatever its header declares (a 66 KB file becomes a
  64 MiB tensor, a few MiB become gigabytes) before a byte of it is checked, and entries
  whose headers point at the same bytes make one stored storage many. Both are refused.
- the legacy format (before 1.6) allocates each storage at the size its pickle declares
  before reading the data, and fills only the storages its trailing key list names: a
  crafted file yields tensors of uninitialised memory, which an import would commit as
  weights. It is refused: re-save such a file with a current PyTorch.
"""

from __future__ import annotations

import io
import os
import zipfile

from ckptflow.errors import CkptflowError
from ckptflow.interop.source_files import check_regular_file

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks at to choose the zip reader over the legacy one


def check_plain_zip(
    source: bytes | str | os.PathLike, what: str, *, error: type[CkptflowError] = CkptflowError
) -> None:
    """Raise ``error`` unless ``source`` (a file, or the bytes of one) is torch.save's zip
    with every entry stored uncompressed and all entries together within its size, so
    ``torch.load`` allocates nothing the bytes do not hold."""
    try:
        if isinstance(source, bytes):
            head, size, archive = source[:4], len(source), zipfile.ZipFile(io.BytesIO(source))
        else:
            check_regular_file(source, error=error)
            with open(source, "rb") as f:
                head = f.read(4)
            size, archive = os.path.getsize(source), zipfile.ZipFile(source)
        with archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        raise error(_not_zip(what, str(e))) from None
    if head != ZIP_MAGIC:  # zipfile finds a zip appended to other bytes; torch.load would read those
        raise error(_not_zip(what, "it does not start with a zip entry"))
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
            raise error(
                f"{what} holds {entry.filename!r} compressed ({entry.compress_size} bytes declaring "
                f"{entry.file_size}); torch.save never compresses, and inflating it could take any amount of memory"
            )
    declared = sum(entry.file_size for entry in entries)
    if declared > size:
        raise error(f"{what} declares {declared} bytes of entries in its {size} bytes; it is damaged or crafted")


def _not_zip(what: str, why: str) -> str:
    return (
        f"{what} is not a readable torch.save file: not in the zip format torch.save has written since "
        f"PyTorch 1.6 ({why}). A legacy-format file can declare storages its bytes do not hold, or leave them "
        "unread, so it is refused: load it where you trust it and save it again with a current PyTorch"
    )
