"""int8 export: per-row symmetric quantization round-trips within half a step."""

import torch
from safetensors import safe_open

from ckptflow import Checkpointer
from ckptflow.quantize import SCALE_SUFFIX, dequantize_int8, export_int8, quantize_int8


def test_quantize_round_trip_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(16, 8, 3)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    err = (dequantize_int8(q, scale) - w).abs().reshape(16, -1).amax(dim=1)
    assert (err <= scale / 2 + 1e-6).all()


def test_export_int8_keeps_small_tensors_and_lineage(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    with Checkpointer(str(tmp_path / "store"), "r") as ck:
        ck.save(5, {"model": model})
    result = export_int8(str(tmp_path / "store"), "r", 5, tmp_path / "m.safetensors")
    with safe_open(result.path, "pt") as f:
        assert f.get_tensor("0.weight").dtype == torch.int8
        assert f.get_tensor("0.bias").dtype == torch.float32
        restored = dequantize_int8(f.get_tensor("0.weight"), f.get_tensor("0.weight" + SCALE_SUFFIX))
        assert f.metadata()["ckptflow.manifest_digest"] == result.digest
    assert torch.allclose(restored, model[0].weight.detach(), atol=model[0].weight.abs().max().item() / 127)
