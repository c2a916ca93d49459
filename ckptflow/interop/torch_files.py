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

Nor does the zip's size bound what its pickle builds: an empty view of a shared storage
costs ~76 bytes of pickle and ~1.5 KB once built (300,000 took torch.load 10 s and 470 MB,
``mmap=True`` the same), and an empty dict one byte and ~70 once built, with no call (40
million, a 40 MB file, took torch.load 20 s and 3.3 GB, the import 165 s and 8.2 GB). So
the pickle is read opcode by opcode first, once its entry is proved stored (inflating a
compressed one is the walk without end: 98 KB took 54 s), and both its calls
(``MAX_CALLS``) and every object it builds or references (``MAX_OBJECTS``) are bounded by what
a file of ``MAX_NAMES`` tensors makes; the files of one import share the bounds
(``PickleBudget``), as are the values it builds counted with all they hold, and the calls it makes
(``pickle_walk``). DCP's ``.metadata`` is walked by the same rule (``count_built``).

Before any of that, ``zipfile`` lists the zip's directory, a ZipInfo of ~500 bytes for each
46-byte record (2 million records, 133 MB, took 1.2 GB), so the count the end record claims
and the records the directory holds are bounded first (``MAX_ENTRIES``), as a file of
``MAX_NAMES`` tensors lists. And ``torch.load``'s reader (miniz) finds the directory where the
end record's offset and zip64's locator point, ``zipfile`` right before them: they must agree,
or the checks would read one directory and ``torch.load`` another.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import IO

from ckptflow.errors import CkptflowError
from ckptflow.interop.pickle_problems import walk_problem
from ckptflow.interop.pickle_walk import PickleBudget, count_built
from ckptflow.interop.source_files import MAX_NAMES, check_regular_file
from ckptflow.interop.torch_save_calls import TORCH_SAVE_CALLS, TORCH_SAVE_STATES

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load looks at to choose the zip reader over the legacy one
# torch.save makes a call per tensor (its rebuild; its hooks' empty OrderedDict is counted as an object)
# and two per Parameter (its rebuild and its data's: ``state_dict(keep_vars=True)``), and a few per file (a
# module's state_dict: its OrderedDict and _metadata), so a file of MAX_NAMES Parameters passes
CALLS_PER_TENSOR = 2
CALLS_PER_FILE = 16
MAX_CALLS = CALLS_PER_TENSOR * MAX_NAMES + CALLS_PER_FILE
# torch.save builds and references 17 to 22 objects per tensor (its name, storage key, sizes, strides, their
# tuples and marks, its calls, memo reads of its globals: 21 for BERT's state dict, 22 for a 6-d tensor of
# large sizes); each costs at most ~70 bytes
OBJECTS_PER_TENSOR = 32
MAX_OBJECTS = OBJECTS_PER_TENSOR * MAX_NAMES
# counted with all they hold, as they are hashed, called or read (``pickle_walk``): 41 to 63 per tensor
VISITS_PER_TENSOR = 96
MAX_VISITS = VISITS_PER_TENSOR * MAX_NAMES
# torch.save writes one zip entry per storage and six of its own (data.pkl, byteorder, version, ...)
# the newest pickle protocol torch.load(weights_only=True) reads: 4 adds opcodes it lacks (FRAME, STACK_GLOBAL)
MAX_PROTOCOL = 3
ENTRIES_PER_FILE = 16
MAX_ENTRIES = MAX_NAMES + ENTRIES_PER_FILE
_CENTRAL_RECORD = struct.Struct("<4s24x3H12x")  # a central directory record: its name, extra, comment lengths
_ZIP64_END_RECORDS = 56 + 20  # zip64's end record and its locator, between the directory and the end record
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # zip64's end locator: its signature, disk, where zip64's end record lies


def check_plain_zip(
    source: bytes | str | os.PathLike,
    what: str,
    *,
    error: type[CkptflowError] = CkptflowError,
    budget: PickleBudget | None = None,
    otherwise: str = "",
) -> None:
    """Raise ``error`` unless ``source`` (a file, or the bytes of one) is torch.save's zip
    with every entry stored uncompressed and all entries together within its size, so
    ``torch.load`` allocates nothing the bytes do not hold, and its pickle builds no more
    calls and objects than ``budget`` (the import's so far, charged with these) has left.
    ``otherwise``: what else its writer may do, after the advice a refused pickle gets."""
    otherwise = f", or, {otherwise}" if otherwise else ""
    budget = PickleBudget() if budget is None else budget
    try:
        if isinstance(source, bytes):
            fp: IO[bytes] = io.BytesIO(source)
        else:
            check_regular_file(source, error=error)
            fp = open(source, "rb")
        with fp:
            head, size = fp.read(4), fp.seek(0, os.SEEK_END)
            if head != ZIP_MAGIC:  # zipfile finds a zip appended to other bytes; torch.load would read those
                raise error(_not_zip(what, "it does not start with a zip entry"))
            _check_directory(fp, what, error)  # before ZipFile lists the entries
            with zipfile.ZipFile(fp) as archive:
                entries = archive.infolist()
                _check_stored(entries, size, what, error)  # before a pickle is read: inflating one has no end
                for entry in entries:
                    if entry.filename.rpartition("/")[2] == "data.pkl":
                        _check_protocol(archive, entry, what, error)
                        _count(archive, entry, budget, what, error)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as e:  # a zip version it lacks
        raise error(_not_zip(what, str(e))) from None
    problem = walk_problem(budget, MAX_VISITS)
    if problem:
        raise error(
            f"{what} {problem}: refused before torch.load runs its pickle. Save tensors and plain values "
            f"(numbers, strings, lists, dicts) with torch.save{otherwise}"
        )
    if budget.calls > MAX_CALLS or budget.objects > MAX_OBJECTS:
        built = (
            f"objects by calls (a tensor is one, a Parameter two) than the {MAX_CALLS} a file of "
            f"{(MAX_CALLS - CALLS_PER_FILE) // CALLS_PER_TENSOR} Parameters makes"
            if budget.calls > MAX_CALLS
            else f"objects (dicts, lists, tuples, strings, numbers, tensors, references) than the {MAX_OBJECTS} a "
            f"file of {MAX_OBJECTS // OBJECTS_PER_TENSOR} tensors makes"
        )
        raise error(
            f"{what} builds more {built}, the most one import takes; refused before torch.load builds "
            "them (each costs memory whatever its size, an empty view or an empty dict too). Import it in parts, "
            f"each a checkpoint of its own{otherwise}"
        )


def _check_stored(entries: list[zipfile.ZipInfo], size: int, what: str, error: type[CkptflowError]) -> None:
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
            raise error(
                f"{what} holds {entry.filename!r} compressed ({entry.compress_size} bytes declaring "
                f"{entry.file_size}); torch.save never compresses, and inflating it could take any amount of memory"
            )
    declared = sum(entry.file_size for entry in entries)
    if declared > size:
        raise error(f"{what} declares {declared} bytes of entries in its {size} bytes; it is damaged or crafted")


def _check_directory(fp: IO[bytes], what: str, error: type[CkptflowError]) -> None:
    """Raise ``error`` unless the zip in ``fp`` has one directory, where both readers look,
    listing at most ``MAX_ENTRIES`` entries: first the count its end record claims, then the
    records it holds (``ZipFile`` reads them all, whatever the count says), each counted
    from its fixed 46 bytes.

    ``ZipFile`` reads the directory right before the end records, and zip64's end record
    right before its locator, whatever offsets they hold; torch.load's reader (miniz) reads
    them where the end record's offset and the locator say. Those must agree, or torch.load
    would read entries no check has seen (a deflated tensor, another pickle)."""
    end = zipfile._EndRecData(fp)  # type: ignore[attr-defined]  # the end record ZipFile reads, zip64's included
    if not end:
        return  # no zip: ZipFile says so
    claimed, size, offset, location = end[4], end[5], end[6], end[9]  # entries, bytes and offset of directory
    zip64 = end[0] == b"PK\x06\x06"
    start = location - size - (_ZIP64_END_RECORDS if zip64 else 0)  # where ZipFile reads it
    if start < 0:
        return  # ZipFile refuses it
    fp.seek(max(location - _ZIP64_LOCATOR.size, 0))
    locator = fp.read(_ZIP64_LOCATOR.size)
    if len(locator) == _ZIP64_LOCATOR.size and locator[:4] == b"PK\x06\x07":
        zip64_at, read_at = _ZIP64_LOCATOR.unpack(locator)[2], location - _ZIP64_END_RECORDS
        if not zip64 or zip64_at != read_at:
            where = f"zip64's end record at byte {read_at}" if zip64 else "no zip64 end record"
            raise error(_not_zip(what, f"its zip64 locator points at byte {zip64_at}, but it follows {where}"))
    if offset != start:
        raise error(_not_zip(what, f"its end record places the zip directory at byte {offset}, but it lies at byte "
                                   f"{start}, right before the end record"))  # fmt: skip
    if claimed > MAX_ENTRIES:
        raise error(_too_many_entries(what, str(claimed)))
    if size < (MAX_ENTRIES + 1) * _CENTRAL_RECORD.size:
        return  # too few bytes to hold more records
    fp.seek(start)
    held = read = 0
    while read < size:
        record = fp.read(_CENTRAL_RECORD.size)
        if len(record) < _CENTRAL_RECORD.size or record[:4] != b"PK\x01\x02":
            return  # a truncated or damaged directory: ZipFile refuses it there
        held += 1
        if held > MAX_ENTRIES:
            raise error(_too_many_entries(what, f"more than {MAX_ENTRIES}"))
        variable = sum(_CENTRAL_RECORD.unpack(record)[1:])
        read += _CENTRAL_RECORD.size + variable
        fp.seek(variable, os.SEEK_CUR)


def _too_many_entries(what: str, count: str) -> str:
    return (
        f"{what} lists {count} entries in its zip directory, more than the {MAX_ENTRIES} a torch.save file of "
        f"{MAX_ENTRIES - ENTRIES_PER_FILE} tensors holds (one per storage, and its own), the most one import "
        "takes; refused before they are read (each costs memory to list). Import it in parts, each a checkpoint "
        "of its own"
    )


def _check_protocol(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, what: str, error: type[CkptflowError]) -> None:
    """Refuse a pickle of a protocol ``torch.load(weights_only=True)`` cannot read (its
    refusal quotes an opcode number, 'Unsupported operand 149', and not the protocol)."""
    with archive.open(entry) as f:
        head = f.read(2)
    if head[:1] == b"\x80" and len(head) == 2 and head[1] > MAX_PROTOCOL:
        raise error(
            f"{what} was pickled with protocol {head[1]} (torch.save(..., pickle_protocol={head[1]})), which "
            "torch.load(weights_only=True) cannot read; save it again with torch.save's default pickle_protocol (2)"
        )


# the lines torch.load(weights_only=True) puts around its reason for refusing any pickle: a preamble,
# then, for a global it does not allow, two numbered options (the first is to load with
# weights_only=False, which ckptflow never does), and the advice to allowlist it after the reason
_WEIGHTS_ONLY_BOILERPLATE = (
    *("Weights only load failed.", "Please file an issue", "Check the documentation"),
    *("(1) ", "(2) "),
)
_UNPICKLER_REASON = "WeightsUnpickler error: "
_ALLOWLIST_ADVICE = " Please use `torch.serialization.add_safe_globals"


def weights_only_refusal(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a pickle: its reason, past the preamble and
    the options it puts around every one (how the default of weights_only changed in PyTorch
    2.6, loading with weights_only=False, allowlisting the global)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    reasons = [line for line in lines if not line.startswith(_WEIGHTS_ONLY_BOILERPLATE)]
    reason = (reasons or lines or [type(e).__name__])[0]
    return reason.removeprefix(_UNPICKLER_REASON).split(_ALLOWLIST_ADVICE)[0]


def _count(
    archive: zipfile.ZipFile, entry: zipfile.ZipInfo, budget: PickleBudget, what: str, error: type[CkptflowError]
) -> None:
    """Walk the pickle in ``entry``; one the walk cannot read is damaged (cut short, altered),
    not a file of another format: the zip it lies in is torch.save's."""
    try:
        with archive.open(entry) as f:
            count_built(
                f,
                budget,
                max_calls=MAX_CALLS,
                max_objects=MAX_OBJECTS,
                max_visits=MAX_VISITS,
                constructors=TORCH_SAVE_STATES,
                calls=TORCH_SAVE_CALLS,
            )
    except (ValueError, EOFError, zipfile.BadZipFile) as e:  # an opcode or argument it cannot read, a bad CRC
        raise error(
            f"{what} is damaged: its pickle {entry.filename} cannot be read ({e}); it was cut short or altered "
            "since torch.save wrote it. Copy or save it again from where it was written"
        ) from None


def _not_zip(what: str, why: str) -> str:
    return (
        f"{what} is not a readable torch.save file: not in the zip format torch.save has written since "
        f"PyTorch 1.6 ({why}). A legacy-format file can declare storages its bytes do not hold, or leave them "
        "unread, so it is refused: load it where you trust it and save it again with a current PyTorch"
    )
