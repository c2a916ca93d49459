"""Tensors' memory as bytes, without copies, and futures already done: what DCP's storage
interface gets from ckptflow's writer and reader."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.futures


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` as a save reads them: its own memory where it is a contiguous
    CPU tensor, else a contiguous CPU copy."""
    if is_own_memory(tensor):
        return tensor_memory(tensor)
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return tensor_memory(flat.contiguous())


def is_own_memory(tensor: torch.Tensor) -> bool:
    """Whether ``bytes_view`` reads ``tensor``'s own memory (which its owner may write
    meanwhile), not a copy made for the save."""
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def tensor_memory(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as writable bytes, without a copy.

    Not through ``.numpy()``: that marks the tensor's storage not resizable for good, so a
    saved (or restored) tensor could no longer be ``resize_``d: a save must not change the
    state it saves. Nor through a view of it: every torch operation lets go of the GIL and
    must take it back, which, with a save's threads busy, costs each of thousands of
    tensors tens of microseconds; its address and size are read directly. The view keeps
    the tensor alive; the caller must not resize it while the view is in use (saves and
    restores hold the tensors they read or fill).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    memory = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    memory._owner = tensor  # type: ignore[attr-defined]  # the bytes live as long as the view does
    return memoryview(memory).cast("B")


def completed_future(value: Any) -> torch.futures.Future:
    """A torch future already holding ``value``: how DCP's storage interface is answered
    for work finished before the call returns."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
