"""Whether a tensor's pieces (boxes: offsets and sizes) tile it exactly.

A DCP checkpoint stores a tensor as pieces that a reader copies into place. Where no
piece lands the reader returns whatever memory held, and where two overlap one piece's
bytes silently win; counting covered elements misses both when they cancel out. So the
rule here is exact: every box inside the tensor, no element in two boxes, none in no box.
``Manifest.parse`` (ckptflow's own DCP index) and the DCP directory import apply it.

It sweeps one dimension at a time: between two consecutive piece boundaries along a
dimension the same boxes are present, and they must tile the remaining dimensions of
that slab. Pieces split along any one dimension, or along several as a grid, cost
O(n log n), and nothing the size of the tensor is built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

Box = tuple[Sequence[int], Sequence[int]]  # offsets, sizes


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` tile ``shape`` exactly; else what is wrong and where: a box
    outside the tensor, two boxes sharing a region, or a region no box covers."""
    ndim = len(shape)
    if any(n < 0 for n in shape):
        return f"its shape {list(shape)} has a negative size"
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim:
            return f"{_piece(offsets, sizes)} has {len(offsets)} dimensions, not {ndim}"
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return f"{_piece(offsets, sizes)} lies outside the tensor's shape {list(shape)}"
    if math.prod(shape) == 0:
        return None  # nothing to cover; empty boxes cover nothing and overlap nothing
    if len(boxes) == 1 and not any(boxes[0][0]) and list(boxes[0][1]) == list(shape):
        return None  # the whole tensor in one piece: most tensors of a single process
    live = [(tuple(o), tuple(n)) for o, n in boxes if math.prod(n)]
    if not ndim:
        return _one_box(live, [])
    levels = [_slabs(live, 0, shape[0])]  # a stack: the slabs still to check in each dimension
    region: list[tuple[int, int]] = []  # the slab being checked in each dimension swept so far
    while levels:
        slab = next(levels[-1], None)
        if slab is None:
            levels.pop()
            continue
        bounds, present = slab
        del region[len(levels) - 1 :]
        region.append(bounds)
        if not present:
            return f"no piece covers {_slice(region + [(0, n) for n in shape[len(region) :]])}"
        if len(region) == ndim:
            problem = _one_box(present, region)
            if problem:
                return problem
        elif len(present) > 1 or not _spans(present[0], len(region), shape):  # else: one box fills the slab
            levels.append(_slabs(present, len(region), shape[len(region)]))
    return None


def _slabs(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], dim: int, end: int
) -> Iterator[tuple[tuple[int, int], list]]:
    """Each stretch of ``dim`` between consecutive piece boundaries (0..end), with the
    boxes present all along it."""
    boxes = sorted(boxes, key=lambda b: b[0][dim])
    cuts = sorted({0, end, *(b[0][dim] for b in boxes), *(b[0][dim] + b[1][dim] for b in boxes)})
    present: list = []
    following = 0
    for start, stop in zip(cuts, cuts[1:]):
        present = [b for b in present if b[0][dim] + b[1][dim] > start]
        while following < len(boxes) and boxes[following][0][dim] <= start:
            present.append(boxes[following])
            following += 1
        yield (start, stop), present


def _spans(box: Box, first: int, shape: Sequence[int]) -> bool:
    """Whether ``box`` spans every dimension from ``first`` on."""
    offsets, sizes = box
    return all(offsets[d] == 0 and sizes[d] == shape[d] for d in range(first, len(shape)))


def _one_box(present: list, region: list[tuple[int, int]]) -> str | None:
    if not present:
        return f"no piece covers {_slice(region)}"
    if len(present) == 1:
        return None
    (ao, an), (bo, bn) = present[0], present[1]
    both = [(max(a, b), min(a + m, b + n)) for a, m, b, n in zip(ao, an, bo, bn)]
    return f"{_piece(ao, an)} and {_piece(bo, bn)} overlap in {_slice(both)}"


def _piece(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return f"the piece at {list(offsets)} of size {list(sizes)}"


def _slice(region: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"
