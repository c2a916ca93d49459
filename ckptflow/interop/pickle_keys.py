"""Dict keys and set elements whose hashes a pickle chooses, as the walk (``pickle_walk``)
counts them: each insertion of a key sharing a hash with those before calls ``==`` with all
of them (``MAX_COLLIDABLE_KEYS``), and keys with distinct hashes can still be chosen to probe
one run of filled slots (``MAX_PROBING_KEYS``); ints a dict takes in ascending order (an
optimizer state's 0, 1, 2...) each have a slot of their own (``keys_taken``).
"""

from __future__ import annotations

from typing import Any

MAX_COLLIDABLE_KEYS = 1024  # their insertions compare with each other: ~500,000 comparisons at most
MAX_PROBING_KEYS = 1 << 16  # crafted to probe one run of slots: ~2 billion probes, ~1 s at most
_HASH_MODULUS = (1 << 61) - 1  # CPython hashes an int by its value modulo this
_HASHED_INT = 1 << 64  # an int key below this is hashed to see whether it shares a hash; above, it is counted as if

# A value on the walk's stack: (weight, what it is, how many values it holds (itself too) whose hash can
# be made equal to another's, how deep it nests: 1 for a value holding none). What it is: ("global",
# dotted name), ("str", the string), ("bytes",), ("int" or "float", the number), ("tuple", its first items'
# kinds), ("keys", ints taken in ascending order, the last of them, the "call" kind of what it was made by or
# None) for a dict or set filled, ("list", its items whose hash is chosen whole: ``listed``), ("storage",) for
# a persistent id's storage, ("call", the dotted name called) for what a call returns, or None (a singleton...)
Kind = tuple[Any, ...] | None
Value = tuple[int, Kind, int, int]


def is_kind(kind: Kind, *what: str) -> bool:
    return bool(kind) and kind[0] in what  # type: ignore[index]


def global_name(kind: Kind) -> str | None:
    """The dotted name of a global, or None for another value. Kinds are told apart by this and
    ``is_kind``, never hashed whole: a tuple's holds its items' (20 levels of memo reads make 4^20
    to hash), an int's its digits (a 1 MB int hashed at each of 20,000 calls took 12 s)."""
    return kind[1] if is_kind(kind, "global") else None  # type: ignore[index]


def call_argument(args: Kind, index: int) -> Kind:
    """What the ``index``-th item of a call's arguments is, if they are a tuple the walk knows."""
    items = args[1] if args and args[0] == "tuple" else ()
    return items[index] if index < len(items) else None


def alike_int(number: int) -> int:
    """1 for an int whose hash another int can share (from 2^61 - 1 on), else 0."""
    return int(not -_HASH_MODULUS < number < _HASH_MODULUS)


def hashed_keys(name: str, fixed: list[Value], items: list[Value]) -> list[Value]:
    """The values an opcode hashes: dict keys and set elements."""
    if name == "SETITEM":
        return fixed[1:2]
    if name in ("DICT", "SETITEMS"):
        return items[::2]
    return items if name in ("ADDITEMS", "FROZENSET") else []


# what a call makes whose hash comes from the numbers it is given, as a tuple's from its items': xxHash's
# rounds are inverted for the last item, so 40,000 pairs of ints below 2^20 hashed alike (847 KB took 11.5 s)
_HASHED_FROM_NUMBERS = {("call", "torch.Size"), ("call", "builtins.complex")}
# calls that hash the elements of the list or dict they are given
HASHING_CALLS = {"builtins.set", "builtins.frozenset", "collections.Counter"}


def chosen_whole(kind: Kind) -> bool:
    """Whether a value of ``kind`` may share its hash with another whatever numbers it holds:
    a tuple's hash inverts for its last item, and a set's, a size's or a complex number's
    are made from its numbers' as freely."""
    return is_kind(kind, "tuple", "keys") or is_kind(kind, "call") and kind in _HASHED_FROM_NUMBERS


def listed(kind: Kind, added: list[Value]) -> Kind:
    """A list's ``kind`` once it holds ``added`` too: ("list", how many of its items hash as
    a key that can share its hash whatever numbers it holds, and hold none that can share
    one themselves), what ``set(list)`` or ``Counter(list)`` adds to the count of the
    numbers the list holds that can share a hash, as ``keys_taken`` counts a dict's keys."""
    before = kind[1] if is_kind(kind, "list") else 0  # type: ignore[index]
    return "list", before + sum([not collides and chosen_whole(item) for _, item, collides, _ in added])


def keys_taken(taken: Kind, hashed: list[Value], hashes: dict[int, Any]) -> tuple[Kind, int, int]:
    """A dict's or set's ``taken`` ("keys", ints taken in ascending order, the last, its maker) once it
    takes the ``hashed`` keys, with how many of those have hashes the file chooses and how
    many share one with another (``hashes``: the first number of each hash the import's
    chosen numbers have, None once another shares it). An int above the last and at most
    1.5 times the count is below the dict's size (CPython grows it past 1.5 times its keys),
    in a slot no other such int has. A tuple, frozenset, size or complex number may share
    its hash whatever numbers it holds; another call's result counts by the numbers it holds
    that can share a hash."""
    _, count, last, made_by = taken  # type: ignore[misc]
    chosen = equal = 0
    for _, kind, collides, _ in hashed:
        number = kind[1] if is_kind(kind, "int", "float") else None  # type: ignore[index]
        if type(number) is int and last < number <= count * 3 // 2:
            count, last = count + 1, number
        elif number is not None and -_HASHED_INT < number < _HASHED_INT:  # a float, or an int worth hashing
            chosen += 1
            first = hashes.setdefault(hash(number), number)
            if first is None or first != number:  # the hash is shared: this key, and the first if not counted yet
                equal += 1 if first is None else 2
                hashes[hash(number)] = None
        elif collides or chosen_whole(kind):  # a huge int unhashed
            chosen, equal = chosen + 1, equal + max(collides, 1)
    return ("keys", count, last, made_by), chosen, equal
