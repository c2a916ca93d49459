"""The calls torch.save writes, and what it gives each (``TORCH_SAVE_CALLS``): the pickle walk
(``pickle_walk.count_built``) refuses a ``.pt`` file's pickle that calls anything else, or gives
one of them anything else, before ``torch.load`` runs it. ``torch.load`` would also run a tensor
class given a size (``torch.FloatTensor(2**28)``: a 1 KB file imported 1 GB of uninitialised
memory), a bytearray given a count (3 GB), a set given a storage to iterate (8 MB took 10 s), or
a rebuild converting a stride-0 view to another dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ckptflow.interop.pickle_keys import Kind, call_argument, global_name, is_kind

_ANY: Callable[[Kind], bool] = lambda args: True
_TENSOR_REBUILDS = {f"torch._utils._rebuild_{name}" for name in ("tensor", "tensor_v2", "tensor_v3", "parameter")}
# tensors that allocate nothing their storages do not hold, which the import then refuses by name (on the meta
# device, sparse, quantized: ``state_checks``)
_REFUSED_LATER = {f"torch._utils._rebuild_{name}" for name in ("meta_tensor_no_storage", "sparse_tensor", "qtensor")}
# what torch.save writes for a nested tensor (torch.nested: strided, jagged), refused by name where it is named
NESTED_TENSORS = {"torch._utils._rebuild_nested_tensor", "torch.nested._internal.nested_tensor._rebuild_njt"}
# the calls torch.save writes for CPU tensors and plain values (pickle protocol 2), with what it gives them:
# a tensor rebuild views the file's storage; bytes come from latin-1 strings, bytearrays from them (or from
# nothing); sets from a list, Counters from a dict (or a list), sizes from a tuple: given a storage or a tensor
# they iterate it element by element (a million int64, 8 MB, took torch.load 10 s); _rebuild_from_type_v2
# calls its first argument, a tensor rebuild. Not a tensor class (given a size it allocates), nor a rebuild
# converting a tensor to another dtype or device (a stride-0 view of one element becomes gigabytes)
TORCH_SAVE_CALLS: dict[str, Callable[[Kind], bool]] = {
    **dict.fromkeys(_TENSOR_REBUILDS | _REFUSED_LATER | {"torch._utils._rebuild_parameter_with_state"}, _ANY),
    **dict.fromkeys(("torch.device", "torch.serialization._get_layout"), _ANY),
    "collections.OrderedDict": lambda args: args == ("tuple", ()),  # then filled: given pairs, it hashes keys unseen
    "torch.Size": lambda args: is_kind(call_argument(args, 0), "tuple"),
    "builtins.complex": _ANY,
    "torch._tensor._rebuild_from_type_v2": lambda args: global_name(call_argument(args, 0)) in _TENSOR_REBUILDS,
    "builtins.set": lambda args: is_kind(call_argument(args, 0), "list"),
    "collections.Counter": lambda args: (
        call_argument(args, 0) is None or is_kind(call_argument(args, 0), "keys", "list")  # {}, ()
    ),
    "builtins.bytearray": lambda args: args == ("tuple", ()) or is_kind(call_argument(args, 0), "str", "bytes"),
    "_codecs.encode": lambda args: (
        is_kind(call_argument(args, 0), "str") and call_argument(args, 1) in (("str", "latin1"), ("str", "latin-1"))
    ),
}

# what torch.save sets a state on (BUILD): a state_dict's OrderedDict, its ``_metadata``; a tensor's is an argument
TORCH_SAVE_STATES = frozenset({"collections.OrderedDict"})


def refused_call(calls: Mapping[str, Callable[[Kind], bool]] | None, target: Kind, args: Kind) -> str:
    """What a call ``calls`` does not allow calls, in words, or ''."""
    if calls is None:
        return ""
    if (dotted := global_name(target)) is None or dotted not in calls:
        return dotted or "a value that is not a named class or function"
    return "" if calls[dotted](args) else f"{dotted} (given what torch.save never gives it)"
