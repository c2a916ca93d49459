"""int8 weights for exports: symmetric per-output-channel quantization in the
compressed-tensors layout, so a standard loader either dequantizes it or refuses it.

Lossy, so only ever for exported model files (never for resume checkpoints, which must
restore bit-exactly). A quantized ``<module>.weight`` is stored as int8 codes next to
``<module>.weight_scale`` (float32, one per output row, shape ``[rows, 1]``);
``w ~= weight * weight_scale``, off by at most half a step (``weight_scale / 2``) per
element. That is compressed-tensors' "naive-quantized" W8A16 format (int, 8 bits,
symmetric, channel strategy), which vLLM serves and transformers loads on CPU when
config.json carries ``quantization_config`` (needs the ``compressed-tensors`` package;
without it transformers raises ImportError instead of loading codes as floats). Strict
loaders (``load_state_dict``, ``safetensors.torch.load_model``) refuse the file: the
``weight_scale`` tensors are unexpected keys. ``ckptflow.interop.export.load_exported``
dequantizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ckptflow.errors import CkptflowError

SCALE = "weight_scale"
ERROR_BOUND = "per element at most half a quantization step: |w - q * scale| <= scale / 2, scale = max|row| / 127"


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes shaped like ``t``, float32 scales ``[rows, 1]``): ``t ~= q * scale``. A
    weight with no elements (a layer of width 0) has codes of its shape and the least scale."""
    rows = _rows(t.float())
    peak = rows.abs().amax(dim=1, keepdim=True) if rows.shape[1] else rows.new_zeros(rows.shape[0], 1)
    scale = peak.clamp(min=1e-12) / 127.0
    q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return q.reshape(t.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (_rows(q.float()) * scale.reshape(-1, 1)).reshape(q.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, the rest]`` (``reshape(rows, -1)`` refuses a tensor of no elements)."""
    return t.reshape(t.shape[0], -1) if t.numel() else t.new_zeros(t.shape[0], 0)


def scale_name(weight: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale``."""
    return weight[: -len("weight")] + SCALE


def quantize_weights(
    tensors: Mapping[str, torch.Tensor], names: Iterable[str], *, where: str = "the checkpoint"
) -> dict[str, torch.Tensor]:
    """``tensors`` with each of ``names`` (``*.weight``) replaced by its codes and scale.

    A weight holding inf or NaN is refused: its row's scale would be inf or NaN, and every
    value of the row would dequantize to NaN, far beyond the error bound promised."""
    names = list(names)
    bad = sorted(name for name in names if not bool(torch.isfinite(tensors[name]).all()))
    if bad:
        raise CkptflowError(
            f"int8 export of {where}: {len(bad)} weight(s) hold inf or NaN ({', '.join(bad[:5])}), which int8 "
            "cannot represent (their rows would load as NaN); export in a floating-point dtype, or from a "
            "checkpoint whose weights are finite"
        )
    out = dict(tensors)
    for name in names:
        out[name], out[scale_name(name)] = quantize_int8(tensors[name])
    return out


def dequantize_weights(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse layout: every int8 ``*.weight`` with a ``*.weight_scale`` becomes float32."""
    out = dict(tensors)
    for name, scale in tensors.items():
        weight = name[: -len(SCALE)] + "weight"
        if (name == SCALE or name.endswith("." + SCALE)) and weight in tensors and tensors[weight].dtype == torch.int8:
            rows = tensors[weight].shape[0] if tensors[weight].dim() else None
            if rows is None or tuple(scale.shape) != (rows, 1) or not scale.is_floating_point():
                raise CkptflowError(
                    f"{name} is {scale.dtype} of shape {tuple(scale.shape)}, but {weight} "
                    f"({tuple(tensors[weight].shape)}) needs a floating-point scale per row, shape [rows, 1]: the file "
                    "is not an int8 export ckptflow wrote (or was changed since); export the checkpoint again"
                )
            out[weight] = dequantize_int8(tensors[weight], scale)
            del out[name]
    return out


def quantization_config(ignore: Iterable[str]) -> dict:
    """config.json's ``quantization_config``: every ``nn.Linear`` but ``ignore`` (module
    names) holds int8 codes and a per-row scale."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "naive-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": int8,
                "input_activations": None,
                "output_activations": None,
                "format": "naive-quantized",
            }
        },
        "ignore": sorted(ignore),
    }
