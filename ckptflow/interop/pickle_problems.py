"""Why the pickle walk (``pickle_walk.count_built``) refuses a pickle, in words: what its
budget recorded beyond the calls and objects each caller bounds and words itself, by the
walk's own bounds."""

from __future__ import annotations

from ckptflow.interop import pickle_walk as walk
from ckptflow.interop.pickle_walk import PickleBudget
from ckptflow.interop.torch_save_calls import NESTED_TENSORS


def walk_problem(budget: PickleBudget, max_visits: int) -> str:
    """Why the walk's budget refuses the pickle beyond its calls and objects, in words, or ''."""
    if budget.refused_call in NESTED_TENSORS:
        return (
            f"holds a nested tensor (torch.nested, rebuilt by {budget.refused_call}), which ckptflow does not "
            "import: save its tensors instead, t.unbind() (a list of them) or t.to_padded_tensor(0.0)"
        )
    if budget.refused_call:
        return (
            f"calls {budget.refused_call} in its pickle, which torch.save writes for no tensor or plain value; "
            "ckptflow never unpickles anything else, since that could run code or allocate memory no byte of the "
            "file holds (a tensor class given a size, a bytearray given a count)"
        )
    if budget.altered:
        return (
            f"sets attributes of {budget.altered} (a BUILD on a class, or on what a lookup returns, not on an object "
            "the unpickler constructs), which no pickler writes: it would change it for the whole process"
        )
    if budget.refilled:
        return "fills a list, dict or object after a memo read referenced it (no state holds itself): uncounted"
    if budget.depth > walk.MAX_DEPTH:
        return (
            f"nests values deeper than {walk.MAX_DEPTH} levels (hashing or reading one recurses a level a level: "
            "200,000 of them crashed the process), where a state nests a few"
        )
    if budget.collidable > walk.MAX_COLLIDABLE_KEYS:
        return (
            f"keys dicts or sets by more than {walk.MAX_COLLIDABLE_KEYS} ints of 2^61 - 1 or more, floats, or tuples "
            "(or sizes, complex numbers), whose hashes can be made equal (each insertion would then compare with "
            "all before)"
        )
    if budget.probing > walk.MAX_PROBING_KEYS:
        return (
            f"keys dicts or sets by more than {walk.MAX_PROBING_KEYS} numbers (beyond ascending ints like an optimizer "
            "state's 0, 1, 2...) or values given to set() or Counter(), whose hashes can be chosen to probe one run "
            "of slots (each insertion would then pass all before); key such a table by strings"
        )
    if budget.visits > max_visits:
        return (
            f"builds values holding more than {max_visits} objects counted with all they reference (a value "
            "referenced twice counts twice: 40 tuples each holding the one before twice hash as 2^40)"
        )
    return ""
