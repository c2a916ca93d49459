"""The calls a torch.save file may make are given only what torch.save gives them.

``set()``, ``Counter()`` and ``torch.Size()`` were allowed anything but a string, yet they
iterate what they are given element by element: given a storage (the persistent id of a zip
entry) of a million int64, 8 MB, torch.load took 9.6 s building a set and 11 s a size, a
second per MB; given a tensor of a million floats, 3 s. The walk saw one value. torch.save
gives a set a list, a Counter a dict and a size a tuple. And ``OrderedDict(pairs)`` hashed its
keys unseen by the bounds on keys: 20,000 ints of 2^61 - 1 or more sharing a hash (400 KB)
took the import 7 s, 21,000 pairs of small ints hashing alike 13 s, and more were bounded only
by the objects a file may build (millions: hours). torch.save writes ``OrderedDict()``, then fills it.
"""

from __future__ import annotations

import collections

import pytest
import torch

from ckptflow.errors import CkptflowError
from ckptflow.interop import importers, pickle_walk

_MODULUS = (1 << 61) - 1


class _Call:
    """Pickles as ``function(*args)``, as a crafted file would."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _refused(path, match: str) -> None:
    with pytest.raises(CkptflowError, match=match):
        importers.import_checkpoint(str(path.parent / "store"), "r", 1, path)
    assert not (path.parent / "store" / "runs").exists()


_COUNT = 1000


@pytest.mark.parametrize(
    ("called", "named", "given", "iterated"),
    [
        (set, "builtins.set", "storage", lambda made: 256 == len(made)),  # each of the 8,000 bytes, 256 values
        (collections.Counter, "collections.Counter", "storage", lambda made: sum(made.values()) == 8 * _COUNT),
        (torch.Size, "torch.Size", "storage", lambda made: len(made) == 8 * _COUNT),
        (set, "builtins.set", "tensor", lambda made: len(made) == _COUNT),  # a tensor per element
        (collections.Counter, "collections.Counter", "tensor", lambda made: len(made) == _COUNT),
    ],
    ids=["set of a storage", "Counter of a storage", "Size of a storage", "set of a tensor", "Counter of a tensor"],
)
def test_a_call_given_a_storage_or_a_tensor_to_iterate_is_refused(tmp_path, called, named, given, iterated):
    values = torch.arange(_COUNT)  # int64: 8,000 bytes
    torch.save({"w": torch.ones(2), "junk": _Call(called, values.untyped_storage() if given == "storage" else values)},
               tmp_path / "iterated.pt")  # fmt: skip
    assert iterated(torch.load(tmp_path / "iterated.pt", weights_only=True)["junk"])  # what torch.load would do
    _refused(tmp_path / "iterated.pt", rf"iterated.pt calls {named} \(given what torch.save never gives it\)")


def test_an_ordered_dict_given_its_pairs_is_refused(tmp_path):
    keys = [5 + i * _MODULUS for i in range(1, pickle_walk.MAX_COLLIDABLE_KEYS + 2)]  # one hash
    torch.save({"w": torch.ones(2), "junk": _Call(collections.OrderedDict, [(key, 0) for key in keys])},
               tmp_path / "pairs.pt")  # fmt: skip
    assert list(torch.load(tmp_path / "pairs.pt", weights_only=True)["junk"]) == keys
    _refused(tmp_path / "pairs.pt", r"pairs.pt calls collections.OrderedDict \(given what torch.save never gives it\)")


def test_sets_counters_sizes_and_ordered_dicts_torch_save_writes_import(tmp_path):
    values = {
        "set": {1, "a", (2, 3)},
        "empty set": set(),
        "counter": collections.Counter("aab"),
        "empty counter": collections.Counter(),
        "size": torch.Size([2, 3]),
        "empty size": torch.Size([]),
        "ordered": collections.OrderedDict(b=1, a=collections.OrderedDict()),
    }
    torch.save({"w": torch.ones(2), "values": values}, tmp_path / "plain.pt")
    assert importers.read_source(tmp_path / "plain.pt").state["values"] == values
