"""The label overlap check the browser test applies to Dagster's plots (tests/dagster/test_ui.py),
on boxes whose overlap is known: it must see overlap where there is some, and none where not."""

from support.canvas_labels import corners, overlap

ROTATED = [0.94, -0.34, 0.34, 0.94]  # 20 degrees, as Chart.js turned the former 30-character keys
DRAWN = {"w": 100.0, "h": 12.0, "x": 0.0, "y": 0.0, "align": "right", "baseline": "middle"}


def test_parallel_rotated_labels_too_close_across_overlap():
    a, b = ({**DRAWN, "m": [*ROTATED, e, 50.0]} for e in (100.0, 120.0))  # 20 px apart: 7 px across
    assert overlap(corners(a), corners(b))


def test_labels_far_enough_apart_do_not():
    a, far = ({**DRAWN, "m": [*ROTATED, 100.0, f]} for f in (50.0, 90.0))
    assert not overlap(corners(a), corners(far))
    beside = {**DRAWN, "m": [1.0, 0.0, 0.0, 1.0, 250.0, 50.0]}  # unrotated, 100 px wide, 150 px right
    assert not overlap(corners({**DRAWN, "m": [1.0, 0.0, 0.0, 1.0, 100.0, 50.0]}), corners(beside))
