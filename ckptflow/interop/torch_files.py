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

Nor does the zip's size bound the tensors its pickle makes: an empty view of a shared
storage costs ~76 bytes of pickle and ~1.5 KB once built (300,000 took torch.load 10 s and
470 MB, ``mmap=True`` the same). The pickle's calls are counted first (``MAX_CALLS``).
"""

from __future__ import annotations

import io
import os
import pickletools
import zipfile

from ckptflow.errors import CkptflowError
from ckptflow.interop.source_files import MAX_NAMES, check_regular_file

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks at to choose the zip reader over the legacy one
_CALL_OPCODES = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
# torch.save makes two calls per tensor (its rebuild, its hooks' OrderedDict), so a file of MAX_NAMES
# tensors passes; one that shares the OrderedDict builds at most twice as many tensors
MAX_CALLS = 2 * MAX_NAMES


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
            calls = [_calls(archive, e) for e in entries if e.filename.rpartition("/")[2] == "data.pkl"]
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
    if sum(calls) > MAX_CALLS:
        raise error(
            f"{what} builds more objects by calls (a tensor is one) than the {MAX_CALLS} a file of "
            f"{MAX_CALLS // 2} tensors makes, the most one import takes; refused before torch.load builds them "
            "(each costs memory whatever its size, an empty view too). Import it in parts, each a checkpoint of its own"
        )


def _calls(archive: zipfile.ZipFile, entry: zipfile.ZipInfo) -> int:
    """How many objects the pickle ``entry`` builds by a call (counted up to one past
    ``MAX_CALLS``), read opcode by opcode (``pickletools.genops`` runs nothing): each tensor
    ``torch.load`` makes is one, so the count bounds them before a single one is built."""
    count = 0
    with archive.open(entry) as f:
        for op, _, _ in pickletools.genops(f):
            count += op.name in _CALL_OPCODES
            if count > MAX_CALLS:
                break
    return count


def _not_zip(what: str, why: str) -> str:
    return (
        f"{what} is not a readable torch.save file: not in the zip format torch.save has written since "
        f"PyTorch 1.6 ({why}). A legacy-format file can declare storages its bytes do not hold, or leave them "
        "unread, so it is refused: load it where you trust it and save it again with a current PyTorch"
    )
