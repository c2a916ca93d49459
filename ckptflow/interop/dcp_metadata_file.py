"""The ``.metadata`` file of a plain torch.distributed.checkpoint directory, read without
running anyone's code.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``: a crafted
file runs code on whoever loads it, and torch 2.13 has no safe mode. It is read here
through an unpickler that resolves only DCP's metadata classes and the few torch values
they hold (``torch.Size``, dtypes, layouts), as torch's ``weights_only`` loader does for
tensors; anything else is refused before it is called, and the result is checked field
by field (``dcp_dir`` then reads the items it describes).

Nor do its bytes bound what it builds: an empty dict is 2 bytes of pickle and ~70 once
built, a memo written at index 2^28 (9 bytes) made the unpickler's memo 4 GB, and memo
reads repeat one chunk in a chunk list (2 bytes each: 8 MB listed 4 million pieces, which
took 0.7 GB to check) or one tensor's description under many names (10,000 names sharing
10,000 pieces, 126 KB, took 128 s). So the pickle is walked first by the rule a ``.pt``
file's is (``pickle_walk.count_built``: its values counted with all they hold too), bounded
by what the metadata of ``MAX_NAMES`` tensors builds, and the names, then the pieces of all
names (those of a shared description counted for each name), are counted against
``MAX_NAMES`` before one is visited. The path it was saved to is built only once its parts
are proved a path's length (``_saved_path``).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pathlib
import pickle
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptflow.errors import DcpFormatError
from ckptflow.format.sealed import MAX_DEPTH
from ckptflow.interop.pickle_keys import MAX_COLLIDABLE_KEYS
from ckptflow.interop.pickle_problems import walk_problem
from ckptflow.interop.pickle_walk import PickleBudget, count_built
from ckptflow.interop.source_files import MAX_NAMES, check_name_count

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # as for ckptflow's own records
# DCP's metadata of a tensor in one piece builds and references 64 to 83 objects (counted as a .pt file's
# pickle is: its name, description, sizes, piece, item, saved path), each further piece ~45, a non-tensor
# value ~24: the metadata of MAX_NAMES tensors, or of as many pieces, passes
METADATA_OBJECTS_PER_TENSOR = 128
MAX_METADATA_OBJECTS = METADATA_OBJECTS_PER_TENSOR * MAX_NAMES
# counted with all they hold, as they are hashed, called or read: 144 per tensor in one piece (50,000 tensors)
METADATA_VISITS_PER_TENSOR = 320
MAX_METADATA_VISITS = METADATA_VISITS_PER_TENSOR * MAX_NAMES

_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a name -> torch.layout lookup
}
# StorageMeta.checkpoint_id: the path it was saved to, built from its parts (``_saved_path``)
_PATHS = {("pathlib", name): getattr(pathlib, name) for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")}
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_FILE_BYTES = 1 << 63  # a file offset or length (off_t)
# what to do with a DCP checkpoint an import refuses but its writer may trust
IF_TRUSTED = "if you trust the checkpoint, dcp.load it yourself and save the state through a Checkpointer"


# the classes DCP's metadata is made of: each call to one constructs an object, the only values a BUILD may
# set the state of (not an enum member ``_MEM_FORMAT_ENCODING(0)`` looks up, shared by the whole process)
_CONSTRUCTED = {(module, name): cls for (module, name), cls in _ALLOWED.items() if dataclasses.is_dataclass(cls)}
_CONSTRUCTORS = frozenset(f"{module}.{name}" for module, name in _CONSTRUCTED)

_PYTHON_OPCODES: dict[int, Callable[[Any], None]] = dict(pickle._Unpickler.dispatch)


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only the globals DCP's ``Metadata`` is made of; everything else (a
    function, a class with side effects) is refused before it can be called. Python's
    own unpickler, not C's, so each opcode that sets a state or hashes a key is checked
    as it runs: the walk refuses what these refuse first, and these hold if it misses one.

    A BUILD may set the state only of an object of DCP's classes, which the pickle
    constructs: on an enum member a lookup returns, it would change the member for every
    user in the process. A ``MetadataIndex`` key hashes as its name and offset, and an
    offset is a size whose hash the file chooses (a tuple's inverts for its last item), so
    keys of one name can all share a hash, each insertion then comparing with all before
    (5,000 took 4.2 s); at most ``MAX_COLLIDABLE_KEYS`` may, the bound the walk sets on
    the keys it can see the hashes of."""

    stack: list[Any]  # Python's unpickler's: what was pushed since the last MARK
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_PYTHON_OPCODES)

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where
        self.first_of_hash: dict[int, Any] = {}  # the first MetadataIndex key of each hash
        self.colliding = 0  # MetadataIndex keys sharing a hash with another

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PATHS:
            return functools.partial(_saved_path, _PATHS[(module, name)], self.where)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise DcpFormatError(
            f"{self.where} refers to {module}.{name}, which is not part of DCP's checkpoint metadata; "
            "ckptflow does not unpickle it (that could run code). Is this a DCP checkpoint from a trusted writer?"
        )

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _CONSTRUCTED.values():
            raise DcpFormatError(
                f"{self.where} sets attributes of {_shown(target)} (a BUILD on a {type(target).__name__}, not on "
                "an object of DCP's metadata it constructs), which no pickler writes: it would change it for the "
                "whole process; refused"
            )
        _PYTHON_OPCODES[pickle.BUILD[0]](self)

    def _hashing(self, keys: list[Any]) -> None:
        """Count the ``MetadataIndex`` among ``keys`` (about to be hashed) that share a hash
        with another, and refuse the file past ``MAX_COLLIDABLE_KEYS`` of them."""
        for key in keys:
            if type(key) is not dcp_metadata.MetadataIndex:
                continue
            first = self.first_of_hash.setdefault(hash(key), key)
            if first is not key and first != key:
                self.colliding += 1 if first is None else 2
                self.first_of_hash[hash(key)] = None
        if self.colliding > MAX_COLLIDABLE_KEYS:
            raise DcpFormatError(
                f"{self.where} keys its storage entries by more than {MAX_COLLIDABLE_KEYS} MetadataIndex (a name "
                "and an offset) sharing a hash with another, whose insertion then compares with all before; "
                "DCP's keys do not share hashes: the metadata was crafted, refused"
            )

    def load_setitem(self) -> None:
        self._hashing(self.stack[-2:-1])
        _PYTHON_OPCODES[pickle.SETITEM[0]](self)

    def load_setitems(self) -> None:
        self._hashing(self.stack[::2])  # what was pushed since the mark
        _PYTHON_OPCODES[pickle.SETITEMS[0]](self)

    def load_dict(self) -> None:
        self._hashing(self.stack[::2])
        _PYTHON_OPCODES[pickle.DICT[0]](self)

    def load_additems(self) -> None:
        self._hashing(self.stack)
        _PYTHON_OPCODES[pickle.ADDITEMS[0]](self)

    def load_frozenset(self) -> None:
        self._hashing(self.stack)
        _PYTHON_OPCODES[pickle.FROZENSET[0]](self)

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset


def _saved_path(path_class: type[pathlib.PurePath], where: str, *parts: Any) -> pathlib.PurePath:
    """The path DCP saved to, refused before it is built if its parts are not strings of a
    path's length: building it splits every part into a list of its directories, so a part
    repeated by memo reads (2 bytes each) cost a list entry per directory per repeat (600 KB
    of ``.metadata`` took 3.6 GB, and would have taken 40)."""
    chars = sum(len(part) for part in parts if isinstance(part, str))
    if not all(isinstance(part, str) for part in parts) or chars + len(parts) > MAX_PATH_CHARS:  # and separators
        raise DcpFormatError(
            f"{where} gives the path it was saved to as {len(parts)} parts of {chars} characters, not a path of at "
            f"most {MAX_PATH_CHARS}; the metadata is damaged or was not written by DCP"
        )
    return path_class(*parts)


def read_metadata(directory: str) -> dcp_metadata.Metadata:
    """The directory's DCP ``Metadata``, unpickled with only DCP's classes allowed, then checked."""
    path = os.path.join(directory, METADATA_FILE)
    where = f"DCP metadata {path}"
    if not os.path.isfile(path):
        raise DcpFormatError(f"{directory} is not a DCP checkpoint directory: it has no {METADATA_FILE} file")
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        raise DcpFormatError(f"{where} is {size} bytes, more than DCP writes for any checkpoint; refused unread")
    with open(path, "rb") as f:
        data = io.BytesIO(f.read())  # within the bound above; walked in memory, the walk takes a third of the time
    try:
        _check_built(data, where)
        data.seek(0)
        metadata = _MetadataUnpickler(data, where).load()
    except DcpFormatError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, RecursionError,
            IndexError, OverflowError, RuntimeError) as e:  # fmt: skip  # RuntimeError: TensorProperties' own
        raise DcpFormatError(f"{where} is not readable DCP metadata ({type(e).__name__}: {e})") from None
    try:
        _check_metadata(metadata, where)
    except AttributeError as e:  # unpickling sets the fields the file holds: one renamed is missing
        raise DcpFormatError(f"{where}: {e}; the metadata is damaged or was not written by DCP") from None
    return metadata


def _check_built(f: Any, where: str) -> None:
    """Refuse the pickle in ``f`` if it builds or references more objects than the metadata
    of ``MAX_NAMES`` tensors does, before the unpickler builds one (its calls are DCP's
    classes, each an object counted)."""
    built = PickleBudget()
    most = MAX_METADATA_OBJECTS
    count_built(f, built, max_calls=most, max_objects=most, max_visits=MAX_METADATA_VISITS, constructors=_CONSTRUCTORS)
    problem = walk_problem(built, MAX_METADATA_VISITS)
    if problem:
        raise DcpFormatError(f"{where} {problem}: refused before it is unpickled; DCP writes nothing of the kind")
    if built.objects > MAX_METADATA_OBJECTS:
        raise DcpFormatError(
            f"{where} builds more objects (dicts, lists, tuples, strings, numbers, references) than the "
            f"{MAX_METADATA_OBJECTS} the metadata of {MAX_METADATA_OBJECTS // METADATA_OBJECTS_PER_TENSOR} tensors "
            "builds, the most one import takes; refused before it is unpickled (each costs memory). If it was "
            "written by DCP, import the checkpoint in parts, each a checkpoint of its own"
        )


def _indices(value: Any) -> bool:
    """Whether ``value`` (a piece's offsets or sizes, an item's offset) is what DCP writes: a
    tuple (``torch.Size``) of integers; another type crashed the checks and the reader."""
    return isinstance(value, tuple) and all(type(n) is int for n in value)


def _shown(value: Any) -> str:
    """``value`` as an error message shows it: its repr, at most 200 characters; an integer
    of more than 4,300 digits cannot be printed (ValueError), which is the message's problem,
    not the caller's."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of more than {sys.get_int_max_str_digits()} digits>"
    return text if len(text) <= 200 else f"{text[:200]}..."


def _check_metadata(md: Any, where: str) -> None:
    """Every field a reader relies on has the type DCP gives it, and every item lies in a
    plain file of the directory."""

    def bad(what: str) -> DcpFormatError:
        return DcpFormatError(f"{where}: {what}; the metadata is damaged or was not written by DCP")

    if not isinstance(md, dcp_metadata.Metadata):
        raise bad(f"it holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise bad("state_dict_metadata or storage_data is not a dict (a checkpoint written by another storage writer?)")
    # a description may be shared by many names, and its pieces are visited for each: counted first
    check_name_count(len(md.state_dict_metadata), where, error=DcpFormatError)
    tensors = {n: t for n, t in md.state_dict_metadata.items() if isinstance(t, dcp_metadata.TensorStorageMetadata)}
    for fqn, tensor in tensors.items():
        if not isinstance(tensor.chunks, list):
            raise bad(f"the pieces of tensor {_shown(fqn)} are not a list")
    pieces = sum(len(tensor.chunks) for tensor in tensors.values())
    check_name_count(
        pieces,
        where,
        error=DcpFormatError,
        what="tensor pieces (shards, those of a description several names share counted for each)",
        advice=f"Import it in parts, each a checkpoint of fewer tensors or shards, or, {IF_TRUSTED} (tensors whole)",
    )
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"the name {_shown(fqn)} is not a string")
        if isinstance(item, dcp_metadata.TensorStorageMetadata):
            props = item.properties
            if not isinstance(item.size, torch.Size) or not isinstance(props, dcp_metadata.TensorProperties):
                raise bad(f"tensor {_shown(fqn)} has no size or properties")
            if not isinstance(props.dtype, torch.dtype):
                raise bad(f"tensor {_shown(fqn)} has no dtype")
            for chunk in item.chunks:
                if (
                    not isinstance(chunk, dcp_metadata.ChunkStorageMetadata)
                    or not _indices(chunk.offsets)
                    or not _indices(chunk.sizes)
                    or len(chunk.offsets) != len(item.size)
                ):
                    raise bad(f"tensor {_shown(fqn)} has a malformed chunk")
        elif not isinstance(item, dcp_metadata.BytesStorageMetadata):
            raise bad(f"{_shown(fqn)} is described by a {type(item).__name__}")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or index.fqn not in md.state_dict_metadata:
            raise bad(f"storage entry {_shown(index)} names nothing in the checkpoint")
        if index.offset is not None and not _indices(index.offset):
            raise bad(f"{_shown(index.fqn)} is stored at {_shown(index.offset)}, not a position in the tensor")
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise bad(f"the storage of {_shown(index.fqn)} is not a file location")
        name = info.relative_path
        if not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
            raise bad(f"{_shown(index.fqn)} is stored in {_shown(name)}, which is not a file name inside the directory")
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_FILE_BYTES
            for n in (info.offset, info.length)
        ):
            raise bad(f"{_shown(index.fqn)} has an invalid offset or length")
        if not isinstance(info.transform_descriptors, (list, tuple, type(None))):
            raise bad(f"{_shown(index.fqn)} has transform descriptors {_shown(info.transform_descriptors)}, not a list")
        if info.transform_descriptors:
            raise DcpFormatError(
                f"{where}: {_shown(index.fqn)} was written through DCP's experimental stream extensions "
                f"({list(info.transform_descriptors)}), which ckptflow does not read; save without extensions"
            )
    paths = md.planner_data
    if paths is not None and not isinstance(paths, dict):
        raise bad("planner_data is not a map of flattened names to key paths")
    for fqn, path in (paths or {}).items():  # a path's depth before its keys: one may be shared by every name
        if fqn not in md.state_dict_metadata:
            raise bad(f"planner_data gives a path for {_shown(fqn)}, which names nothing in the checkpoint")
        if not isinstance(path, tuple) or not path:
            raise bad("planner_data is not a map of flattened names to key paths")
        if len(path) > MAX_DEPTH:
            raise bad(
                f"the saved path of {_shown(fqn)} is {len(path)} keys deep, more than the {MAX_DEPTH} a state nests"
            )
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            raise bad("planner_data is not a map of flattened names to key paths")
    # DCP flattens every element of a list to at least one item, so a list index is below
    # the number of items; a larger one would only allocate (or, negative, fail) rebuilding
    # the index, so the lists' lengths, and how deep a path goes bound what rebuilding makes: a
    # path of 100,000 indexes 999 among 1,000 items, 300 KB of metadata, made 10^8 list slots.
    # A list is known by the number of the prefix it extends, not a copy of it: copies cost
    # the square of a path's depth (1,000 paths 128 deep, 280 KB, took 77 MB and 3 s to check)
    items = len(md.state_dict_metadata)
    prefixes: dict[tuple[int, str | int], int] = {}  # (a prefix's number, the key extending it) -> its number
    slots: dict[int, int] = {}  # each list rebuilding makes (the number of its prefix) -> its length
    for fqn, path in (paths or {}).items():
        if any(isinstance(k, int) and not 0 <= k < items for k in path):
            raise bad(f"the saved path of {_shown(fqn)} ({_shown(path)}) has a list index outside 0..{items - 1}")
        prefix = -1  # the state itself
        for key in path:
            if isinstance(key, int):
                slots[prefix] = max(slots.get(prefix, 0), key + 1)
            prefix = prefixes.setdefault((prefix, key), len(prefixes))
    if sum(slots.values()) > items * MAX_DEPTH:  # DCP stores at least one item per element of every list
        raise bad(f"its saved paths make lists of {sum(slots.values())} elements in all, for {items} items")
