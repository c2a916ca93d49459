"""The one walk of a pickle before anything unpickles it (``count_built``): a ``.pt`` file's
and each DCP item's before ``torch.load`` (``torch_files``), DCP's ``.metadata`` before its
restricted unpickler (``dcp_metadata_file``). ``pickletools.genops`` reads the opcodes and
runs nothing; the walk keeps the unpickler's stack and memo beside it, so it knows what each
value holds and what each call is given.

A pickle's bytes do not bound what unpickling it and reading the result cost:

- every object: an empty dict is one byte of pickle and ~70 once built, a memo written at
  index i makes CPython's unpickler's memo i long (``objects``);
- a value counted with all it holds (``visits``): a memo read repeats a whole value in two
  bytes, so 40 tuples each holding the one before twice is 2^40 tuples to hash as a dict key
  (a 1.5 KB file hung torch.load) or for a reader to walk; a string weighs one more per
  ``STRING_UNIT`` bytes, as a call copying it, or a save writing it wherever it is
  referenced, costs (per 64 bytes, a 132 KB file of dicts keyed by two 64 KB strings wrote
  255 MB). Each dict key and set element
  (hashed), each call's arguments and the result (which readers walk) are charged;
- dict keys and set elements whose hashes the file chooses: ints hash as their value modulo
  2^61 - 1 and floats as the rational they are, so from 2^61 - 1 on ints, and floats at all,
  can share one hash, and each insertion calls ``==`` with all before (20,000 took 2 s, a
  million would take hours), as can tuples (and sizes, complex numbers) of any numbers, whose
  hash inverts for their last item (``pickle_keys``): at most ``MAX_COLLIDABLE_KEYS``
  (``collidable``). Distinct
  hashes do not save the rest: a dict probes the slots its hash picks, so ints of any size
  (43,682 below 2^20 took 0.48 s, 87,373 took 1.8 s, a million would take minutes) can be
  chosen to probe one run of filled slots. At most ``MAX_PROBING_KEYS`` of them, but for
  ints a dict takes in ascending order, none past 1.5 times the count taken so far (an
  optimizer state's 0, 1, 2...): each is below the dict's size, in a slot of its own
  (``probing``). What ``set(...)`` or ``Counter(...)`` is given, but a dict (whose keys were
  counted), counts with all it holds, its elements hashed by the call;
- how deep a value nests (``depth``): hashing a dict key, comparing or printing a value recurses
  in C, so a key nested 200,000 deep (a 200 KB file, a byte a level) killed the import process
  with SIGSEGV; a state nests at most ``state_checks.MAX_NESTING`` levels anyway, so at most
  ``MAX_DEPTH``;
- calls (``calls``), and, for torch.save's pickles, only those torch.save writes, given what
  it gives them (``torch_save_calls``).
"""

from __future__ import annotations

import pickletools
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from ckptflow.interop.pickle_keys import (
    HASHING_CALLS,
    MAX_COLLIDABLE_KEYS,
    MAX_PROBING_KEYS,
    Kind,
    Value,
    alike_int,
    call_argument,
    global_name,
    hashed_keys,
    is_kind,
    keys_taken,
    listed,
)
from ckptflow.interop.state_checks import MAX_NESTING
from ckptflow.interop.torch_save_calls import NESTED_TENSORS, refused_call

STRING_UNIT = 16  # bytes of a string or number that weigh as much as one object (~70 bytes built)
# levels a value may nest: a state's (``MAX_NESTING``) twice over, and a tensor's rebuild (~10 levels)
MAX_DEPTH = 2 * MAX_NESTING + 32

_CALL_OPCODES = {"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
# opcodes that build nothing: the singletons and cached small ints (a stack slot each), those that fill a
# container or set a state (a slot of it: what they add is built, and counted, before), and memo writes
# (charged by their index). A memo read or DUP is a reference that readers visit again (2 bytes repeat a
# chunk in DCP metadata's chunk list), and a MARK makes a list in torch.load's unpickler (10 MB of them
# took it 0.7 GB): they count as objects
_NO_OBJECT_OPCODES = {
    *("STOP", "POP", "POP_MARK", "PROTO", "FRAME", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "BININT1"),
    *("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"),
}
# a memo written at index i (MEMOIZE's is the memo's length): CPython's unpickler grows its memo to 2i slots
# (9 bytes writing index 2^28 took it 4 GB); writers number entries in order, below what was built before
_MEMO_WRITES = {"PUT", "BINPUT", "LONG_BINPUT"}

_BYTES: Kind = ("bytes",)
_PLAIN: Value = (1, None, 0, 1)
_EMPTY_TUPLE: Value = (1, ("tuple", ()), 0, 1)
_EMPTY_LIST: Value = (1, ("list", 0), 0, 1)
_STORAGE: Kind = ("storage",)

# how the walk takes each opcode (``_PLAN``)
_MEMO_WRITE, _MEMOIZE, _GET, _MARK, _NOTHING, _STOP, _POP, _DUP = range(8)
_LEAF, _EMPTY, _STRING, _BYTE_STRING, _NUMBER, _GLOBAL, _STACK_GLOBAL = range(8, 15)
_TUPLE, _MARKED_TUPLE, _FILL, _MARKED_FILL, _CALL = range(15, 20)
_STEPS = {
    **dict.fromkeys(_MEMO_WRITES, _MEMO_WRITE), "MEMOIZE": _MEMOIZE, "MARK": _MARK, "STOP": _STOP, "POP": _POP,
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _GET), "PROTO": _NOTHING, "FRAME": _NOTHING, "DUP": _DUP,
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE"), _STRING),
    "BINUNICODE8": _STRING, **dict.fromkeys(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"), _BYTE_STRING),
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"), _NUMBER),
    "GLOBAL": _GLOBAL, "STACK_GLOBAL": _STACK_GLOBAL, **dict.fromkeys(("EMPTY_TUPLE", "EMPTY_LIST"), _EMPTY),
    "TUPLE": _MARKED_TUPLE,
    **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), _TUPLE), **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX"), _CALL),
    **dict.fromkeys(("APPEND", "SETITEM", "BUILD", "READONLY_BUFFER", "BINPERSID"), _FILL),
    **dict.fromkeys(("APPENDS", "LIST", "DICT", "SETITEMS", "ADDITEMS", "FROZENSET", "POP_MARK"), _MARKED_FILL),
    "INST": _MARKED_FILL, "OBJ": _MARKED_FILL,
}  # fmt: skip
# every other opcode pushes a value read from nothing (None, an empty list, an extension code...)
_PLAN = {  # an opcode's step, whether it counts as an object, as a call, and how many values it takes
    op.name: (_STEPS.get(op.name, _LEAF), op.name not in _NO_OBJECT_OPCODES, op.name in _CALL_OPCODES,
              len(op.stack_before))
    for op in pickletools.opcodes
}  # fmt: skip
assert all(not op.stack_before and len(op.stack_after) == 1 for op in pickletools.opcodes if op.name not in _STEPS)

_ORDERED_DICT: Kind = ("global", "collections.OrderedDict")  # torch.save writes an empty one for a tensor's hooks


@dataclass
class PickleBudget:
    """What the pickles of one import built so far: a DCP directory's items together stay
    within the bounds of one file."""

    calls: int = 0
    objects: int = 0
    visits: int = 0  # values counted with all they hold, as they are hashed, called or read
    collidable: int = 0  # dict keys and set elements whose hash is, or can be made, another's
    probing: int = 0  # dict keys and set elements whose hashes the file chooses
    hashes: dict[int, Any] = field(default_factory=dict)  # the number keys' hashes (``pickle_keys.keys_taken``)
    depth: int = 0  # the deepest a value nests
    refused_call: str = ""  # a call torch.save does not write, or a nested tensor's rebuild: what it calls
    refilled: bool = False  # a container filled after a memo read or DUP referenced it
    altered: str = ""  # what a BUILD sets the state of that the unpickler did not construct, in words


def count_built(
    f: IO[bytes],
    budget: PickleBudget,
    *,
    max_calls: int,
    max_objects: int,
    max_visits: int,
    constructors: Collection[str],
    calls: Mapping[str, Callable[[Kind], bool]] | None = None,
) -> None:
    """Charge ``budget`` with what the pickle in ``f`` builds (until it is over a bound):
    each call but an empty ``OrderedDict()`` (a tensor's hooks, an object like ``{}``), every
    other object or reference an opcode, a memo written at index i as i objects, the visits
    and the keys whose hashes the file chooses the module docstring describes; and, with
    ``calls``, record the first call to anything else, or given anything else, than it allows.
    The unpickler's stack is kept as ``Value``s, its marks as the stack's length at each. A
    pickler memoizes a container before filling it: the memo holds a cell (``[value, read]``)
    its fills update, so a memo read weighs all it holds (``l = [l, l]`` 40 times, 1.7 KB, was
    40 values, and days for the import to walk); one filled once read is ``refilled``. A BUILD
    (a state set) may target only what one of the ``constructors`` returns, each call a new
    object: on a class, or on what a lookup returns (an enum member, a layout), it would change
    a value every user in the process shares (``altered``)."""
    first = objects = budget.objects
    called, visits, collidable, refused = budget.calls, budget.visits, budget.collidable, budget.refused_call
    probing = budget.probing
    deepest = budget.depth
    cap = max_visits + 1  # weights saturate: past the bound they need not be exact
    stack: list[Value] = []
    cells: list[list[Any] | None] = []  # the memo cell of each stack value that has one (None past its end)
    marks: list[int] = []
    memo: dict[int, Any] = {}  # a Value, or a container's cell
    refilled, altered = budget.refilled, budget.altered

    def cell_at(position: int) -> list[Any] | None:
        return cells[position] if 0 <= position < len(cells) else None

    def tie(cell: list[Any]) -> None:
        """Tie the top value to a memo ``cell``: what fills it then updates the cell."""
        cells.extend([None] * (len(stack) - len(cells)))
        cells[len(stack) - 1] = cell

    def pop(n: int, *, to_mark: bool = False) -> list[Value]:
        """The top ``n`` values (``to_mark``: those above the top mark, and the mark)."""
        if to_mark and not marks:
            raise ValueError("a pickle opcode that needs a MARK found none")
        if to_mark:
            n = len(stack) - marks.pop()
        elif len(stack) - (marks[-1] if marks else 0) < n:
            raise ValueError("a pickle opcode found its stack too short")
        items = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        del cells[len(stack) :]
        return items

    def made(items: list[Value], kind: Kind = None, *, filled: bool = False) -> Value:
        """A value holding ``items`` (``filled``: the first is a container or object they
        fill, as deep as it was or one more than they are)."""
        nonlocal deepest
        weight, collides, depth = 1, 0, 1
        for value in items[1:] if filled else items:
            weight += value[0]
            collides += value[2]
            depth = max(depth, value[3] + 1)
        if filled:
            weight += items[0][0]
            collides += items[0][2]
            depth = max(depth, items[0][3])
        deepest = max(deepest, depth)
        return (weight if weight < cap else cap), kind, collides, depth

    for op, opcode_arg, _ in pickletools.genops(f):
        arg: Any = opcode_arg
        step, counts, call, taken = _PLAN[op.name]
        objects += counts
        if step == _GET:
            if arg not in memo:
                raise ValueError(f"a pickle memo read of {arg}, never written")
            entry = memo[arg]
            if type(entry) is list:  # a container's cell: filling it now would add to what this was counted as
                entry[1] = True
                stack.append(entry[0])
                tie(entry)
            else:
                stack.append(entry)
        elif step == _MEMOIZE or step == _MEMO_WRITE:
            if not stack:
                raise ValueError("a pickle memo write found an empty stack")
            index = arg if step == _MEMO_WRITE else len(memo)  # MEMOIZE writes at the memo's length
            objects = max(objects, first + index)
            written: Any = stack[-1]
            if not is_kind(written[1], *_NEVER_FILLED):
                written = cell_at(len(stack) - 1) or [written, False]
                tie(written)
            memo[index] = written
        elif step == _LEAF or step == _EMPTY:
            stack.append(_PLAIN if step == _LEAF else _EMPTY_LIST if op.name == "EMPTY_LIST" else _EMPTY_TUPLE)
        elif step == _MARK:
            marks.append(len(stack))
        elif step == _NUMBER and isinstance(arg, float):
            stack.append((1, ("float", arg), 1, 1))
        elif step == _NUMBER:
            alike = alike_int(arg)
            stack.append((min(1 + arg.bit_length() // 8 // STRING_UNIT, cap), ("int", arg), alike, 1))
        elif step == _STRING or step == _BYTE_STRING:
            kind = ("str", arg) if step == _STRING else _BYTES
            stack.append((min(1 + len(arg) // STRING_UNIT, cap), kind, False, 1))
        elif step == _TUPLE or step == _MARKED_TUPLE:
            items = pop(taken, to_mark=step == _MARKED_TUPLE)
            stack.append(made(items, ("tuple", tuple([v[1] for v in items[:4]]))))
        elif step == _CALL:  # REDUCE, NEWOBJ, NEWOBJ_EX: the callable, then its arguments
            items = pop(taken)
            called += items[0][1] != _ORDERED_DICT or items[1][1] != ("tuple", ())  # an empty one is an object
            callee = global_name(items[0][1])
            value = made(items, _BYTES if callee == "_codecs.encode" else ("call", callee))
            visits += value[0] - 1 - items[0][0]  # its arguments
            refused = refused or refused_call(calls, items[0][1], items[1][1])
            if callee in HASHING_CALLS:  # set(list), frozenset(list), Counter(list): its elements hashed
                given = call_argument(items[1][1], 0)
                collidable += items[1][2] + (given[1] if is_kind(given, "list") else 0)  # type: ignore[index]
                probing += 0 if is_kind(call_argument(items[1][1], 0), "keys") else items[1][0]  # a dict's were counted
            stack.append(value)
        elif step == _FILL or step == _MARKED_FILL:  # a container filled, a state set, INST and OBJ called
            called += call
            items = pop(0, to_mark=True) if step == _MARKED_FILL else []
            below = _FILLED.get(op.name, 0) if step == _MARKED_FILL else taken  # the container, what it takes
            cell = cell_at(len(stack) - below) if below and op.name in _FILLS else None
            refilled = refilled or bool(cell and cell[1])
            fixed = pop(below)
            if op.name == "BUILD" and not altered:
                altered = _altered(fixed[0][1], constructors)
            hashed = hashed_keys(op.name, fixed, items)
            visits += sum([v[0] for v in hashed])
            filling = fixed[0][1] if fixed and op.name in _FILLS else None
            made_by = filling if is_kind(filling, "call") else None  # an OrderedDict() filled is still its call's
            taken_keys = filling if is_kind(filling, "keys") else ("keys", 0, -1, made_by)
            if hashed:
                taken_keys, chosen, equal = keys_taken(taken_keys, hashed, budget.hashes)
                probing, collidable = probing + chosen, collidable + equal
            kind = fixed[0][1] if op.name in ("READONLY_BUFFER", "BUILD") else taken_keys if hashed else None
            if op.name in ("APPEND", "APPENDS", "LIST"):
                kind = listed(filling, fixed[1:] + items)
            elif op.name == "BINPERSID":
                kind = _STORAGE
            if op.name in ("INST", "OBJ"):
                target = ("global", _dotted(arg)) if op.name == "INST" else (items[0][1] if items else None)
                kind = ("call", global_name(target))  # what it returns, as a REDUCE's
                args = items if op.name == "INST" else items[1:]
                visits += sum([v[0] for v in args])
                refused = refused or refused_call(calls, target, ("tuple", tuple([v[1] for v in args[:4]])))
            if op.name != "POP_MARK":
                stack.append(made(fixed + items, kind, filled=bool(fixed) and op.name in _FILLS))
                if cell:
                    cell[0] = stack[-1]
                    tie(cell)
        elif step == _GLOBAL or step == _STACK_GLOBAL:
            if step == _GLOBAL:
                dotted: str | None = _dotted(arg)
            else:
                module, attr = (v[1] for v in pop(2))
                dotted = f"{module[1]}.{attr[1]}" if module and attr and module[0] == attr[0] == "str" else None
            stack.append((1, ("global", dotted), 0, 1))
            if calls is not None and dotted in NESTED_TENSORS:  # refused by name, before what it is given
                refused = refused or dotted
        elif step == _DUP:
            cell = cell_at(len(stack) - 1)
            stack.extend(pop(1) * 2)
            cell = cell or [stack[-1], False]
            cell[1] = True  # read twice from now on
            tie(cell)
            cells[-2] = cell
        elif step == _POP:
            pop(1, to_mark=len(stack) == (marks[-1] if marks else -1))  # a MARK with nothing above it goes
        elif step == _STOP:
            visits += pop(1)[0][0]  # the result, which readers walk
        if (
            called > max_calls
            or objects > max_objects
            or visits > max_visits
            or collidable > MAX_COLLIDABLE_KEYS
            or probing > MAX_PROBING_KEYS
            or deepest > MAX_DEPTH
            or refused
            or refilled
            or altered
        ):  # fmt: skip
            break
    budget.objects, budget.calls, budget.visits, budget.collidable = objects, called, visits, collidable
    budget.depth, budget.probing = deepest, probing
    budget.refused_call = refused
    budget.refilled, budget.altered = refilled, altered


# what a value of these kinds is once made stays (a container's is a cell in the memo: ``count_built``)
_NEVER_FILLED = ("str", "bytes", "int", "float", "tuple", "global")
# the values below its top mark an opcode fills
_FILLED = {"APPENDS": 1, "SETITEMS": 1, "ADDITEMS": 1}
# the opcodes that fill the container or object below what they add (not one they make)
_FILLS = {"APPEND", "SETITEM", "BUILD", "APPENDS", "SETITEMS", "ADDITEMS"}


def _dotted(module_and_name: str) -> str:
    """A GLOBAL's ``module name`` as the unpicklers resolve it: Python 2's names (pickle protocol 2
    writes ``__builtin__ set``) mapped to Python 3's."""
    module, _, name = module_and_name.partition(" ")
    module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
    return f"{module}.{name}"


def _altered(target: Kind, constructors: Collection[str]) -> str:
    """What a BUILD on ``target`` would set the state of, in words, if the unpickler did not
    construct it (a call to one of ``constructors``), or ''."""
    if is_kind(target, "global"):
        return global_name(target) or "a class or function"
    target = target[3] if is_kind(target, "keys") else target  # type: ignore[index]  # a dict: what made it
    if is_kind(target, "call") and target[1] in constructors:  # type: ignore[index]
        return ""
    made_by = target[1] if is_kind(target, "call") else None  # type: ignore[index]
    return f"what {made_by} returns" if made_by else "a value it did not construct"
