"""Dict keys and set elements whose hashes a file chooses are bounded by what they can cost.

Every int from 2^31 on and every float counted against 1,024 keys "whose hashes can be made
equal", so a dict keyed by 5,000 millisecond timestamps (a real torch.save) was refused. Yet
CPython hashes an int as its value modulo 2^61 - 1: ints below that hash distinctly, and only
keys that share a hash make each insertion call ``==`` with all before. Distinct hashes are
not safe either: a dict probes the slots its hash picks, and ints of any size, 2^20 or 2^61,
can be chosen so that each probes one run of filled slots (87,373 distinct ints below 2^20
took 1.8 s to put in a dict, against 4 ms for as many random ones; a million would take
minutes), which the old bound let through below 2^31. So keys sharing a hash stay at 1,024,
keys whose hash is chosen are bounded by ``MAX_PROBING_KEYS`` (65,536: ~1 s at worst), and ints
a dict takes in ascending order (an optimizer state's 0, 1, 2...) each have a slot of their own.
A set's elements, hashed by the ``set(list)`` call torch.save writes for it, were not counted;
then they were counted only if they could share a hash, as were a tuple's items, though a
tuple of small ints can be given any hash (and ``Counter(list)`` was not counted at all).
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

from ckptflow.errors import CkptflowError
from ckptflow.interop import importers, pickle_walk

LIMIT = 1000
_MODULUS = (1 << 61) - 1  # CPython's int hash is the value modulo this


def _refused(path, match: str) -> None:
    with pytest.raises(CkptflowError, match=match):
        importers.import_checkpoint(str(path.parent / "store"), "r", 1, path)
    assert not (path.parent / "store" / "runs").exists()


def _probing_keys(bits: int, table_bits: int) -> list[int]:
    """Distinct ints below 2^bits that, put in a dict in this order, each probe one run of
    filled slots of its 2^table_bits table: half the table filled along the probe cycle
    (i -> 5i + 1) at first, then keys whose every probe lands in the run, so each walks to
    its end (CPython's ``dictobject.c``: slot = hash & mask, then perturb >>= 5, slot = 5 slot
    + perturb + 1)."""
    rng, size = random.Random(0), 1 << table_bits
    cycle = [0]
    while len(cycle) < size:
        cycle.append((5 * cycle[-1] + 1) % size)
    keys = [slot + rng.randrange(1, 1 << (bits - table_bits)) * size for slot in cycle[: size // 2]]
    filled, taken = set(cycle[: size // 2]), set(keys)
    while len(keys) < 2 * size // 3 - 8:  # below the size at which the dict grows
        key = slot = rng.choice(cycle[: len(filled)])
        shift = 5
        while key >> shift:  # each 5 more bits of the key pick its next slot
            start = table_bits + shift - 5
            options = [key | b << start for b in range(1 << max(min(5, bits - start), 0)) if start < bits or not b]
            options = [k for k in options if (5 * slot + (k >> shift) + 1) % size in filled]
            if not options:
                break
            key = rng.choice(options)
            slot, shift = (5 * slot + (key >> shift) + 1) % size, shift + 5
        else:
            if key not in taken:
                keys.append(key)
                taken.add(key)
                filled.add(cycle[len(filled)])  # it lands right after the run
    return keys


def test_a_dict_keyed_by_millisecond_timestamps_or_64_bit_seeds_imports(tmp_path):
    rng = random.Random(1)
    values = {
        "loss_at": {1_733_000_000_000 + 997 * i: float(i) for i in range(5000)},
        "run_of_seed": {rng.getrandbits(64): i for i in range(2000)},  # 7 in 8 of them 2^61 - 1 or more
        "lr_at": {i / 7: i for i in range(1000)},
    }
    torch.save({"w": torch.ones(2), "values": values}, tmp_path / "timestamps.pt")
    state = importers.read_source(tmp_path / "timestamps.pt").state
    assert state["values"] == values


def test_an_optimizer_state_keyed_0_1_2_imports_past_the_probing_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(pickle_walk, "MAX_PROBING_KEYS", 100, raising=False)
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(300)]
    optimizer = torch.optim.Adam(params)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "adam.pt")
    state = importers.read_source(tmp_path / "adam.pt").state
    assert sorted(state["state"]) == list(range(300))


@pytest.mark.parametrize("bits", [20, 61])
def test_distinct_ints_chosen_to_probe_one_run_of_slots_are_refused(tmp_path, monkeypatch, bits):
    monkeypatch.setattr(pickle_walk, "MAX_PROBING_KEYS", LIMIT, raising=False)
    keys = _probing_keys(bits, 12)
    assert len(keys) > LIMIT and len(set(keys)) == len(keys) and max(keys) < 1 << bits
    assert len({key % _MODULUS for key in keys}) == len(keys)  # no two share a hash
    torch.save({"w": torch.ones(2), "junk": dict.fromkeys(keys)}, tmp_path / "probing.pt")
    _refused(tmp_path / "probing.pt", f"probing.pt keys dicts or sets by more than {LIMIT} numbers")


def test_a_set_of_ints_sharing_a_hash_is_counted(tmp_path):
    """torch.save writes a set as ``set([...])``: its elements were hashed unseen by the bound."""
    elements = {1 + i * _MODULUS for i in range(1, pickle_walk.MAX_COLLIDABLE_KEYS + 2)}
    torch.save({"w": torch.ones(2), "junk": elements}, tmp_path / "set.pt")
    _refused(tmp_path / "set.pt", f"set.pt keys dicts or sets by more than {pickle_walk.MAX_COLLIDABLE_KEYS} ints")


_XXPRIME_1, _XXPRIME_2, _XXPRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_U64 = (1 << 64) - 1


def _pairs_sharing_a_hash(count: int) -> list[tuple[int, int]]:
    """Pairs of ints below 2^61 that CPython hashes alike: a tuple's hash (``tupleobject.c``,
    xxHash's rounds over its items' hashes) is inverted for the second item."""

    def rotated(x: int, by: int) -> int:
        return ((x << by) | (x >> (64 - by))) & _U64

    inverse_1, inverse_2 = pow(_XXPRIME_1, -1, 1 << 64), pow(_XXPRIME_2, -1, 1 << 64)
    before_length = (12345 - (2 ^ _XXPRIME_5 ^ 3527539)) & _U64  # the hash wanted, less the length's part
    pairs: list[tuple[int, int]] = []
    first = 0
    while len(pairs) < count:
        first += 1
        after_first = rotated((_XXPRIME_5 + first * _XXPRIME_2) & _U64, 31) * _XXPRIME_1 & _U64
        second = ((rotated(before_length * inverse_1 & _U64, 33) - after_first) * inverse_2) & _U64
        if second < _MODULUS - 1:  # an int hashes as itself below 2^61 - 1
            pairs.append((first, second))
    return pairs


class _ComplexOfInts:
    """A complex number pickled as ``complex(real, imag)`` of two ints, as a crafted file would."""

    def __init__(self, *parts: int):
        self.parts = parts

    def __reduce__(self):
        return complex, self.parts


@pytest.mark.parametrize("of", ["tuples", "complex numbers"])
def test_tuples_or_complex_numbers_of_small_ints_sharing_a_hash_are_refused(tmp_path, of):
    """A tuple's or complex number's hash was counted by the numbers it holds that can share
    one, so pairs of ints below 2^61 passed uncounted, yet their hashes can be made equal:
    40,000 pairs (847 KB) took the import 11.5 s, a million would take hours. A complex
    number hashes as its real part plus 1000003 times its imaginary part."""
    count = pickle_walk.MAX_COLLIDABLE_KEYS + 1
    if of == "tuples":
        keys: list = _pairs_sharing_a_hash(count)
    else:
        keys = [_ComplexOfInts(1000003 * (count - i), i) for i in range(count)]  # torch.save writes floats
    loaded = [complex(*key.parts) if of != "tuples" else key for key in keys]
    assert len({hash(key) for key in loaded}) == 1 and len(set(loaded)) == len(keys)
    torch.save({"w": torch.ones(2), "junk": dict.fromkeys(keys)}, tmp_path / "pairs.pt")
    _refused(tmp_path / "pairs.pt", f"pairs.pt keys dicts or sets by more than {pickle_walk.MAX_COLLIDABLE_KEYS}")


class _ListGiven(list):
    """A list torch.save writes as ``called(list)``, as a crafted file would."""

    def __init__(self, called, items):
        super().__init__(items)
        self.called = called

    def __reduce__(self):
        return self.called, (list(self),)


@pytest.mark.parametrize("called", [set, collections.Counter], ids=["set", "Counter"])
def test_a_set_or_counter_of_a_list_of_probing_ints_is_refused(tmp_path, monkeypatch, called):
    """The ``set(list)`` and ``Counter(list)`` calls hash the list's elements, which were
    counted only if they could share a hash: 174,754 ints chosen to probe one run of slots,
    866 KB, took the import 14 s as a Counter."""
    monkeypatch.setattr(pickle_walk, "MAX_PROBING_KEYS", LIMIT, raising=False)
    keys = _probing_keys(20, 12)
    torch.save({"w": torch.ones(2), "junk": _ListGiven(called, keys)}, tmp_path / "probing.pt")
    assert len(torch.load(tmp_path / "probing.pt", weights_only=True)["junk"]) == len(keys) > LIMIT
    _refused(tmp_path / "probing.pt", f"probing.pt keys dicts or sets by more than {LIMIT} numbers")


def test_tuple_keys_sets_and_counters_of_a_real_state_import(tmp_path):
    values = {
        "loss_at": {(epoch, step): float(step) for epoch in range(10) for step in range(50)},  # 1,024 at most
        "head_of": {(f"layer{i}", i % 12): i for i in range(400)},
        "seen": set(range(2000)) | {f"tag{i}" for i in range(1000)},
        "counts": collections.Counter({i * 7: i for i in range(2000)}),
    }
    torch.save({"w": torch.ones(2), "values": values}, tmp_path / "real.pt")
    assert importers.read_source(tmp_path / "real.pt").state["values"] == values


@pytest.mark.parametrize("given", ["a set of tuples", "a set of complex numbers", "a Counter of a list of tuples"])
def test_set_elements_of_small_ints_sharing_a_hash_are_refused(tmp_path, given):
    """``set(list)`` counted the numbers its elements hold that can share a hash, not each
    element whose own hash can be chosen: 21,800 pairs of ints below 2^61 hashing alike (442
    KB) were bounded only by the 65,536 keys whose hash is chosen, and took the import 4.4 s."""
    count = pickle_walk.MAX_COLLIDABLE_KEYS + 1
    if given == "a set of complex numbers":
        elements: list = [_ComplexOfInts(1000003 * (count - i), i) for i in range(count)]
        assert len({hash(complex(*element.parts)) for element in elements}) == 1
    else:
        elements = _pairs_sharing_a_hash(count)
    junk = set(elements) if given.startswith("a set") else _ListGiven(collections.Counter, elements)
    torch.save({"w": torch.ones(2), "junk": junk}, tmp_path / "set.pt")
    assert len(torch.load(tmp_path / "set.pt", weights_only=True)["junk"]) == count
    _refused(tmp_path / "set.pt", f"set.pt keys dicts or sets by more than {pickle_walk.MAX_COLLIDABLE_KEYS} ints")


def test_a_set_of_as_many_tuples_as_the_bound_imports(tmp_path):
    pairs = {(i, i % 7) for i in range(pickle_walk.MAX_COLLIDABLE_KEYS)}
    torch.save({"w": torch.ones(2), "pairs": pairs, "sizes": [torch.Size([i]) for i in range(2000)]}, tmp_path / "p.pt")
    assert importers.read_source(tmp_path / "p.pt").state["pairs"] == pairs
