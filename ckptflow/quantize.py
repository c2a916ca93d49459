"""int8 weight export for serving and archives: symmetric per-output-channel quantization.

Lossy, so only ever for exported model files (never for resume checkpoints, which must
restore bit-exactly). Each floating-point tensor of 2+ dimensions becomes ``<name>``
(int8) plus ``<name>.scale`` (float32, one per output row); ``w ~= q * scale``. Small
or 1-D tensors (biases, norms) stay as saved: they are a rounding error in size and
sensitive to precision. The file is a plain safetensors file with the same lineage
metadata as ``export_safetensors``.
"""

from __future__ import annotations

import os

import torch

from ckptflow.export import ExportResult, lineage_metadata, load_tensors, write_safetensors
from ckptflow.store import Store, open_store

SCALE_SUFFIX = ".scale"


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 per-row scales) with ``t ~= q * scale[:, None, ...]``."""
    rows = t.float().reshape(t.shape[0], -1)
    scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(t.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float().reshape(q.shape[0], -1) * scale[:, None]).reshape(q.shape)


def export_int8(store: Store | str, run: str, step: int, out: str | os.PathLike, *, key: str = "model") -> ExportResult:
    """Write ``key``'s tensors of checkpoint ``(run, step)`` to ``out`` with int8 weights."""
    tensors, manifest = load_tensors(open_store(store), run, step, prefix=key.rstrip(".") + ".")
    quantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() >= 2:
            quantized[name], quantized[name + SCALE_SUFFIX] = quantize_int8(t)
        else:
            quantized[name] = t.contiguous()
    out = os.path.abspath(os.fspath(out))
    metadata = lineage_metadata(run, step, manifest.digest, key, **{"ckptflow.quantization": "int8-symmetric-per-row"})
    nbytes = write_safetensors(quantized, out, metadata)
    return ExportResult(run, step, out, len(quantized), nbytes, manifest.digest)
