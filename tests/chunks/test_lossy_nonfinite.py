"""An int8 lossy copy keeps exact a chunk holding a NaN or an infinity, and names its tensor.

int8 stores one absmax/127 scale per block of 256 values: one inf made the scale inf and
one NaN made it NaN, so every value of that block decoded to NaN (inf/inf, 0*inf, x/NaN),
silently: a moment with one overflowed element restored with 256 of them NaN.
"""

from __future__ import annotations

import numpy as np
import torch

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import codecs
from ckptflow.chunks.lossy import ArchiveCodec, LossStats, describe, encode_lossy
from ckptflow.store import open_store

RUN = "nf"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # NaN compares bit for bit


def test_int8_keeps_a_chunk_holding_inf_and_nan_exact_and_names_it():
    torch.manual_seed(0)
    moment = torch.randn(1024) * 1e-3
    moment[3], moment[700] = float("inf"), float("nan")
    exact = moment.numpy()
    stats = LossStats()
    values, parts = encode_lossy(memoryview(exact.tobytes()), "int8", stats, "optimizer", name="optim.state.0.exp_avg")
    assert values.tobytes() == exact.tobytes()  # every value, the inf and the NaN included
    stored = bytes(codecs.decode(b"".join(bytes(p) for p in parts), expected=exact.nbytes))
    assert stored == exact.tobytes()
    assert stats.kept_exact == ["optim.state.0.exp_avg"]
    assert stats.as_dict()["optimizer"] == {"rms_relative_error": 0.0, "max_abs_error": 0.0}
    finite = np.random.default_rng(0).standard_normal(1024).astype("<f4")
    values, _ = encode_lossy(memoryview(finite.tobytes()), "int8", stats, "optimizer", name="optim.state.1.exp_avg")
    assert values.tobytes() != finite.tobytes() and stats.kept_exact == ["optim.state.0.exp_avg"]  # still 8-bit


def test_an_int8_copy_of_a_real_optimizer_restores_the_non_finite_moment_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).pow(2).mean().backward()
    optim.step()
    moment = optim.state[model[0].weight]["exp_avg"]
    moment[0, 3], moment[1, 5] = float("inf"), float("nan")  # one overflowed element, one NaN
    wanted = moment.clone()
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, {"model": model, "optim": optim})
    report = lifecycle.archive(hot, arc, RUN, 1, codec=ArchiveCodec.parse("int8"))
    assert report.ok, report.problems
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    target_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    target_optim = torch.optim.AdamW(target_model.parameters(), lr=1e-3)
    with Checkpointer(hot, RUN, tiers=[arc]) as ck:
        ck.restore({"model": target_model, "optim": target_optim}, allow_lossy=True)
    restored = target_optim.state[target_model[0].weight]["exp_avg"]
    assert torch.equal(_bits(restored), _bits(wanted))
    others = target_optim.state[target_model[0].weight]["exp_avg_sq"]
    assert torch.isfinite(others).all()  # the other moments still went through int8
    lossy = catalog.read_manifest(arc, RUN, 1).lossy
    assert [name.endswith("exp_avg") for name in lossy["kept_exact"]] == [True]
    assert "1 tensors holding NaN or inf kept exact" in describe(lossy)
