"""Lossy archive codecs: explicit, recorded, and never restored unasked.

Resume checkpoints are always bit-exact. For checkpoints aging into the archive tier
an ``ArchiveCodec`` may trade exactness for size, per class of tensor:

* ``weights``: ``exact`` or ``bf16`` (fp32 weights rounded to the nearest bf16);
* ``optimizer``: ``exact``, ``int8`` (each optimizer moment in 8-bit codes with one
  absmax scale per block of 256 values) or ``drop`` (the copy holds the model only).

The loss happens once, when the copy is written: a rounded tensor is an ordinary
tensor whose values happen to be bf16 (or code x scale), stored by an exact codec
(``codecs`` "bf16" / "q8") and addressed by the hash of those values, so verify,
restore, GC and archival treat the copy like any other checkpoint. Its manifest's
``lossy`` record says what was lost (and how much: RMS and max error per class), and
``Checkpointer.restore`` refuses it unless called with ``allow_lossy=True``, and
``export`` unless called with ``allow_lossy=True`` (``--allow-lossy``): one rule,
``check_allowed``. What is made from a copy keeps the record: an export carries it in
every file, and an import of that export commits it again (``Checkpointer.save(lossy=)``).

Which tensors are optimizer state is read from the state's JSON skeleton: an entry
saved from an optimizer is ``{"state": ..., "param_groups": ...}`` (DCP's optimizer
state dict); its floating-point tensors with more than one element are its moments
(step counters stay exact). Every other floating-point fp32 tensor is a weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptflow.chunks import codecs
from ckptflow.errors import LossyCopyError
from ckptflow.format.sealed import json_problem

WEIGHTS = ("exact", "bf16")
OPTIMIZER = ("exact", "int8", "drop")
Q8_BLOCK = 256
PRESETS = {
    "exact": ("exact", "exact"),
    "bf16": ("bf16", "exact"),
    "bf16+int8": ("bf16", "int8"),
    "int8": ("exact", "int8"),
    "model-only": ("exact", "drop"),
    "model-only-bf16": ("bf16", "drop"),
}


@dataclass(frozen=True)
class ArchiveCodec:
    weights: str = "exact"
    optimizer: str = "exact"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS or self.optimizer not in OPTIMIZER:
            raise ValueError(
                f"archive codec weights={self.weights!r}, optimizer={self.optimizer!r}: weights must be one of "
                f"{WEIGHTS}, optimizer one of {OPTIMIZER} (or use a preset: {sorted(PRESETS)})"
            )

    @classmethod
    def parse(cls, text: str | None) -> ArchiveCodec:
        """A preset name (``bf16+int8``, ``model-only``, …) or ``weights=bf16,optimizer=int8``."""
        text = (text or "exact").strip()
        if text in PRESETS:
            return cls(*PRESETS[text])
        fields: dict[str, str] = {}
        for part in text.split(","):
            name, sep, value = part.partition("=")
            if not sep or name.strip() not in ("weights", "optimizer"):
                raise ValueError(
                    f"archive codec {text!r} is not a preset ({', '.join(sorted(PRESETS))}) nor "
                    "'weights=exact|bf16,optimizer=exact|int8|drop'"
                )
            fields[name.strip()] = value.strip()
        return cls(**fields)

    @property
    def exact(self) -> bool:
        return self.weights == "exact" and self.optimizer == "exact"

    @property
    def name(self) -> str:
        return f"weights={self.weights},optimizer={self.optimizer}"


def optimizer_entries(skeleton: Any) -> set[str]:
    """Top-level state entries that hold an optimizer's state dict."""
    if not isinstance(skeleton, dict):
        return set()
    return {k for k, v in skeleton.items() if isinstance(v, dict) and "state" in v and "param_groups" in v}


def tensor_class(fqn: str, dtype: str, numel: int, optimizers: set[str]) -> str:
    """``weights``, ``optimizer`` (a moment) or ``other`` (kept exact whatever the codec)."""
    entry, _, rest = fqn.partition(".")
    if entry in optimizers:
        return "optimizer" if rest.startswith("state.") and dtype == "float32" and numel > 1 else "other"
    return "weights" if dtype == "float32" else "other"


@dataclass
class LossStats:
    """How far the stored values are from the exact ones, per class of tensor."""

    tensors: dict[str, int] = field(default_factory=dict)
    sq_err: dict[str, float] = field(default_factory=dict)
    sq_ref: dict[str, float] = field(default_factory=dict)
    max_abs: dict[str, float] = field(default_factory=dict)
    kept_exact: list[str] = field(default_factory=list)  # tensors with a chunk int8 could not hold: NaN or inf

    def add(self, what: str, exact: np.ndarray, stored: np.ndarray) -> None:
        """Add one chunk's errors. A NaN or infinity stored as it was costs nothing; a value
        the copy lost (a NaN or infinity stored where the value was another, as every value
        of an int8 block holding a NaN is, or the reverse) is an infinite error. So no NaN
        reaches ``max``, whose answer with one depends on the order of its arguments: a
        lost value no longer vanished from ``max_abs_error`` while it made the RMS NaN."""
        exact64, stored64 = exact.astype(np.float64), stored.astype(np.float64)
        kept = (stored64 == exact64) | (np.isnan(stored64) & np.isnan(exact64))
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, NaN - x: replaced just below
            diff = np.where(kept, 0.0, np.where(np.isfinite(stored64 - exact64), stored64 - exact64, np.inf))
        finite = exact64[np.isfinite(exact64)]
        self.sq_err[what] = self.sq_err.get(what, 0.0) + float(np.dot(diff, diff))
        self.sq_ref[what] = self.sq_ref.get(what, 0.0) + float(np.dot(finite, finite))
        self.max_abs[what] = max(self.max_abs.get(what, 0.0), float(np.max(np.abs(diff))) if len(diff) else 0.0)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            what: {
                "rms_relative_error": _relative(self.sq_err[what], self.sq_ref[what]),
                "max_abs_error": self.max_abs[what],
            }
            for what in sorted(self.sq_err)
        }


def _relative(sq_err: float, sq_ref: float) -> float:
    """The RMS error relative to the values' RMS; a value lost where every finite one
    was 0 (a NaN in an int8 block of zeros) is an infinite error there, not none."""
    if sq_ref:
        return (sq_err / sq_ref) ** 0.5
    return 0.0 if sq_err == 0 else math.inf


def encode_lossy(raw: memoryview, how: str, stats: LossStats, what: str, *, name: str) -> tuple[np.ndarray, list]:
    """(the values the copy stores, their encoded chunk) for one fp32 chunk of tensor
    ``name``, rounded ``how`` ("bf16" or "int8"); the error against ``raw`` goes into ``stats``.

    A chunk holding a NaN or an infinity is kept exact under int8 (named in
    ``stats.kept_exact``): its block's absmax scale would be NaN or inf, which turns every
    value of the block into NaN or garbage, a loss no scale can bound. bf16 keeps them as they are."""
    exact = np.frombuffer(raw, dtype="<f4")
    if how == "int8" and not np.isfinite(exact).all():
        if name not in stats.kept_exact:
            stats.kept_exact.append(name)
        stats.add(what, exact, exact)
        return exact, codecs.encode(raw, "zstd", exact.itemsize, floating=True)
    if how == "bf16":
        import torch  # only where weights are rounded: the Dagster code location loads this module

        values = torch.from_numpy(exact.copy()).to(torch.bfloat16).to(torch.float32).numpy()
        parts = codecs.encode_bf16(values.tobytes())
    elif how == "int8":
        codes, scales = quantize_q8(exact, Q8_BLOCK)
        values, parts = codecs.encode_q8(codes, scales, Q8_BLOCK)
    else:
        raise ValueError(f"no lossy encoding {how!r}")
    stats.add(what, exact, values)
    return values, parts


def quantize_q8(values: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes and one fp32 scale (absmax / 127) per ``block`` values."""
    n = len(values)
    padded = np.zeros(-(-n // block) * block, dtype=np.float32)
    padded[:n] = values
    rows = padded.reshape(-1, block)
    scales = (np.abs(rows).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
    return codes.reshape(-1)[:n], scales


def describe(lossy: Mapping[str, Any]) -> str:
    """One line: what a lossy copy lost."""
    parts = []
    if lossy.get("weights") == "bf16":
        parts.append("weights rounded to bf16")
    if lossy.get("optimizer") == "int8":
        parts.append(f"optimizer moments in 8-bit blocks of {lossy.get('block', Q8_BLOCK)}")
    if lossy.get("dropped"):
        parts.append(f"{', '.join(lossy['dropped'])} dropped")
    if lossy.get("kept_exact"):
        parts.append(f"{len(lossy['kept_exact'])} tensors holding NaN or inf kept exact")
    return "; ".join(parts) or "nothing (exact)"


def dropped(manifest: Any) -> list[str]:
    """State entries a manifest's lossy copy does not hold (none for an exact checkpoint)."""
    return list((manifest.lossy or {}).get("dropped") or [])


def check_allowed(manifest: Any, *, allow_lossy: bool, how_to_allow: str, where: str = "") -> None:
    """The rule restore and export share: a lossy copy is used only when asked for.
    Raises ``LossyCopyError`` (``where`` names it; ``how_to_allow`` says how to ask)."""
    if manifest.lossy is None or allow_lossy:
        return
    prefix = f"{where} is " if where else ""
    raise LossyCopyError(f"{prefix}a lossy archive copy ({describe(manifest.lossy)}); {how_to_allow}")


def record_problem(record: Any) -> str | None:
    """Why ``record`` cannot be a manifest's ``lossy`` record (None if it can): a JSON
    object whose ``dropped`` and ``kept_exact``, if present, list state entry and tensor names."""
    if not isinstance(record, dict):
        return f"a lossy record must be a JSON object, not {type(record).__name__}"
    problem = json_problem(record, "the lossy record")
    if problem:
        return problem
    for key, what in (("dropped", "state entry names"), ("kept_exact", "tensor names")):
        names = record.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return f"the lossy record's {key!r} is not a list of {what}"
    return None
