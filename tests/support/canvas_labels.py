"""What a browser test reads of labels Chart.js draws on a canvas (Dagster's asset plots):
each ``fillText`` recorded with the transform it was drawn under, and whether two drawn
labels' boxes overlap on the page."""

from __future__ import annotations

# Chart.js draws axis labels on a canvas, out of the DOM's reach: record every label drawn,
# with the transform it was drawn under (its rotation), to check their boxes on the page.
RECORD_LABELS = """
window.__labels = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, maxWidth) {
  const m = this.getTransform();
  const px = parseFloat((/([0-9.]+)px/.exec(this.font) || [0, "12"])[1]);
  this.canvas.__id = this.canvas.__id || String(Math.random());
  window.__labels.push({text: String(text), x, y, m: [m.a, m.b, m.c, m.d, m.e, m.f],
    w: this.measureText(String(text)).width, h: px, align: this.textAlign,
    baseline: this.textBaseline, canvas: this.canvas.__id});
  return fillText.call(this, text, x, y, maxWidth);
};
"""


def corners(label: dict) -> list[tuple[float, float]]:
    """The label's box on the page: its text box where it was drawn, through its transform."""
    w, h, x, y = label["w"], label["h"], label["x"], label["y"]
    left = {"right": x - w, "end": x - w, "center": x - w / 2}.get(label["align"], x)
    top = {"middle": y - h / 2, "top": y, "hanging": y}.get(label["baseline"], y - h)
    a, b, c, d, e, f = label["m"]
    return [
        (a * px + c * py + e, b * px + d * py + f)
        for px, py in ((left, top), (left + w, top), (left + w, top + h), (left, top + h))
    ]


def overlap(p: list[tuple[float, float]], q: list[tuple[float, float]]) -> bool:
    """Whether two convex quadrilaterals overlap by more than a pixel (separating axes)."""
    for poly in (p, q):
        for i in range(4):
            (x1, y1), (x2, y2) = poly[i], poly[(i + 1) % 4]
            nx, ny = y2 - y1, x1 - x2
            norm = (nx * nx + ny * ny) ** 0.5 or 1.0
            on_p = [(nx * x + ny * y) / norm for x, y in p]
            on_q = [(nx * x + ny * y) / norm for x, y in q]
            if min(max(on_p), max(on_q)) - max(min(on_p), min(on_q)) <= 1.0:
                return False
    return True
