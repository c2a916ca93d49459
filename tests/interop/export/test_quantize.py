"""int8 quantization: per-row symmetric, within half a step; the compressed-tensors layout."""

import pytest
import torch

from ckptflow.errors import CkptflowError
from ckptflow.interop.export.quantize import (
    SCALE,
    dequantize_int8,
    dequantize_weights,
    quantization_config,
    quantize_int8,
    quantize_weights,
)


def test_quantize_round_trip_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(16, 8, 3)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16, 1)
    err = (dequantize_int8(q, scale) - w).abs().reshape(16, -1).amax(dim=1)
    assert (err <= scale.flatten() / 2 + 1e-6).all()


def test_weights_layout_round_trips_and_leaves_the_rest():
    torch.manual_seed(0)
    tensors = {"fc.weight": torch.randn(4, 6), "fc.bias": torch.randn(4), "emb.weight": torch.randn(5, 6)}
    quantized = quantize_weights(tensors, ["fc.weight"])
    assert set(quantized) == {"fc.weight", "fc." + SCALE, "fc.bias", "emb.weight"}
    assert quantized["fc.weight"].dtype == torch.int8 and quantized["emb.weight"] is tensors["emb.weight"]
    restored = dequantize_weights(quantized)
    assert set(restored) == set(tensors) and torch.allclose(restored["fc.weight"], tensors["fc.weight"], atol=0.02)
    config = quantization_config({"lm_head"})
    assert config["ignore"] == ["lm_head"] and config["config_groups"]["group_0"]["weights"]["num_bits"] == 8


def test_a_weight_holding_inf_or_nan_is_refused_not_written_as_nan_rows():
    """Its row's scale became inf or NaN and the whole row loaded as NaN, silently."""
    for bad in (float("inf"), float("nan")):
        weight = torch.randn(4, 8)
        weight[2, 5] = bad
        with pytest.raises(CkptflowError, match=r"int8 export of run r: 1 weight\(s\) hold inf or NaN \(fc.weight\)"):
            quantize_weights({"fc.weight": weight, "fc.bias": torch.zeros(4)}, ["fc.weight"], where="run r")


@pytest.mark.parametrize("scale", [torch.ones(1), torch.ones(4), torch.ones(4, 2), torch.ones(4, 1, dtype=torch.int32)])
def test_a_scale_table_of_another_shape_is_refused_not_broadcast(scale):
    """One scale for every row was broadcast silently (the loaded weights wrong, no error);
    the other shapes raised a bare RuntimeError from inside torch."""
    codes, _ = quantize_int8(torch.randn(4, 6))
    with pytest.raises(CkptflowError, match=r"fc.weight_scale is .* needs a floating-point scale per row"):
        dequantize_weights({"fc.weight": codes, "fc." + SCALE: scale})


@pytest.mark.parametrize("shape", [(4, 0), (0, 6), (0, 0)])
def test_a_weight_of_no_elements_round_trips(shape):
    """A layer of width 0 (or with no rows) raised a bare RuntimeError from amax/reshape."""
    layers = quantize_weights({"fc.weight": torch.empty(shape)}, ["fc.weight"])
    assert layers["fc." + SCALE].shape == (shape[0], 1)
    assert dequantize_weights(layers)["fc.weight"].shape == shape
