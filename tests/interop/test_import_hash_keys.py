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
A set's elements, hashed by the ``set(list)`` call torch.save writes for it, were not counted.
"""

from __future__ import annotations

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
