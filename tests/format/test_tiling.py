"""The one rule for a tensor's pieces (``ckptflow.format.tiling``): they tile it exactly. Checked
against counting every element, on many pieces, and where a manifest applies it."""

from __future__ import annotations

import random

import numpy as np
import torch

from ckptflow import Checkpointer, open_store
from ckptflow.catalog import checkpoints as catalog
from ckptflow.format.tiling import tiling_problem
from support.corrupt import reseal_manifest


def counted(shape, boxes) -> bool:
    """Whether ``boxes`` tile ``shape``, by counting every element."""
    cover = np.zeros(shape, dtype=np.int64)
    for offsets, sizes in boxes:
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return False
        cover[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
    return bool((cover == 1).all())


def at(values: tuple, dim: int, value: int) -> tuple:
    return values[:dim] + (value,) + values[dim + 1 :]


def split(rng: random.Random, shape: tuple[int, ...]) -> list:
    """A random tiling of ``shape``: boxes cut in two along random dimensions."""
    boxes = [((0,) * len(shape), shape)]
    for _ in range(rng.randint(0, 8) if shape else 0):
        i, dim = rng.randrange(len(boxes)), rng.randrange(len(shape))
        offsets, sizes = boxes[i]
        if sizes[dim] > 1:
            cut = rng.randint(1, sizes[dim] - 1)
            first = (offsets, at(sizes, dim, cut))
            second = (at(offsets, dim, offsets[dim] + cut), at(sizes, dim, sizes[dim] - cut))
            boxes[i : i + 1] = [first, second]
    return boxes


def test_tiling_agrees_with_counting_every_element():
    rng = random.Random(20)
    outcomes = {True: 0, False: 0}
    for _ in range(3000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        boxes = split(rng, shape)
        damage = rng.random()
        if damage < 0.5:  # one box moved or resized by one
            i = rng.randrange(len(boxes))
            offsets, sizes = boxes[i]
            boxes[i] = (tuple(max(0, o + rng.randint(-1, 1)) for o in offsets),
                        tuple(max(0, n + rng.randint(-1, 1)) for n in sizes))  # fmt: skip
        elif damage < 0.6:
            boxes.pop(rng.randrange(len(boxes)))
        elif damage < 0.7:
            boxes.append(rng.choice(boxes))
        exact = counted(shape, boxes)
        assert (tiling_problem(shape, boxes) is None) == exact, (shape, boxes)
        outcomes[exact] += 1
    assert min(outcomes.values()) > 500  # both kinds were tried


def test_problems_are_named_with_their_region():
    shape = (6, 4)
    assert tiling_problem(shape, [((0, 0), (3, 4)), ((2, 0), (3, 4))]) == (
        "the piece at [0, 0] of size [3, 4] and the piece at [2, 0] of size [3, 4] overlap in [2:3, 0:4]"
    )
    assert tiling_problem(shape, [((0, 0), (6, 1)), ((0, 1), (6, 3)), ((0, 2), (1, 1))]) == (
        "the piece at [0, 1] of size [6, 3] and the piece at [0, 2] of size [1, 1] overlap in [0:1, 2:3]"
    )
    assert tiling_problem(shape, [((0, 0), (3, 4)), ((3, 0), (3, 2))]) == "no piece covers [3:6, 2:4]"
    assert tiling_problem(shape, [((0, 0), (3, 4)), ((3, 0), (4, 4))]) == (
        "the piece at [3, 0] of size [4, 4] lies outside the tensor's shape [6, 4]"
    )
    assert tiling_problem((), [((), ()), ((), ())]) is not None and tiling_problem((), []) is not None
    assert tiling_problem((), [((), ())]) is None
    assert tiling_problem((0, 4), [((0, 0), (0, 4)), ((0, 0), (0, 4))]) is None  # nothing to cover
    assert tiling_problem((3,), [((0,), (3,)), ((3,), (0,)), ((3,), (0,))]) is None  # empty DTensor shards


def test_many_pieces_split_along_any_dimension_or_as_a_grid():
    """Column shards (every piece spans all rows) and a grid: the sweep meets each piece
    a few times, not once per other piece."""
    n = 50_000
    columns = [((0, i), (2, 1)) for i in range(n)]
    assert tiling_problem((2, n), columns) is None
    assert tiling_problem((2, n), [*columns, ((1, n - 1), (1, 1))]) == (
        f"the piece at [0, {n - 1}] of size [2, 1] and the piece at [1, {n - 1}] of size [1, 1] overlap in "
        f"[1:2, {n - 1}:{n}]"
    )
    grid = [((i, j, 0), (1, 1, 3)) for i in range(200) for j in range(200)]
    assert tiling_problem((200, 200, 3), grid) is None
    assert tiling_problem((200, 200, 3), grid[:-1]) == "no piece covers [199:200, 199:200, 0:3]"


def test_a_manifest_whose_shards_overlap_is_refused_naming_the_region(tmp_path):
    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        ck.save(1, {"model": {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4)}})
        ck.save(2, {"model": {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4) * 2}})

    def overlapping(record):
        record["dcp"]["tensors"]["model.w"]["chunks"] = [
            {"offsets": [0, 0], "sizes": [5, 4]},
            {"offsets": [3, 0], "sizes": [5, 4]},
        ]

    reseal_manifest(root, "r", 2, overlapping)
    report = catalog.verify_checkpoint(open_store(root), "r", 2)
    assert not report.ok
    assert "'model.w' (shape [8, 4]) that do not tile it" in report.problems[0]
    assert "overlap in [3:5, 0:4]" in report.problems[0]
    with Checkpointer(root, "r") as ck:
        assert ck.restore({"model": {"w": torch.zeros(8, 4)}}).step == 1
